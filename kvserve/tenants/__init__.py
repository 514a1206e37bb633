"""Tenants and their API keys: who may call the API, and whether their text may be stored."""
