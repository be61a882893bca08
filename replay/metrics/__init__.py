"""Reading engines' Prometheus metrics into samples. Runs in: frontend process.

scrape (each /metrics URL into per-engine KV-usage samples), restarts (a server that
restarted between two readings: a fault, never a drain).
"""
