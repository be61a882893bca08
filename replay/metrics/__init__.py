"""Reading engines' Prometheus metrics into samples. Runs in: frontend process.

scrape (each /metrics URL into per-engine KV-usage samples), restarts (a server that
restarted between two readings: a fault, never a drain), promql (selectors and answers
of Prometheus's HTTP API), prometheus (the same series read through a Prometheus server).
"""
