"""Management commands of the tenants app."""
