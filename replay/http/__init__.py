"""OpenAI-compatible HTTP: the front of `serve --http`, the replay client of `--target http://`, and Prometheus scraping."""
