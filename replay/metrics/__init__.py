"""Reading engines' Prometheus metrics into samples. Runs in: frontend process.

scrape (each /metrics URL into per-engine KV-usage samples).
"""
