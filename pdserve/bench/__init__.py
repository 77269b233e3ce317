"""Benchmark clients: they use the router's public OpenAI API only."""
