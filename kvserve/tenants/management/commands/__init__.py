"""create_api_key."""
