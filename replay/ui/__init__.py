"""The live view. Runs in: frontend process.

dashboard (its state as plain data), tui (the rich render and LiveView), monitor (feeds
it from a replay, a serve or its stats), metrics_top (`kvdrain top --metrics`),
prometheus_top (`kvdrain top --prometheus`).
"""
