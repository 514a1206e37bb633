"""Incidents (ownership violations and other guard failures), canary runs, and admin releases of quarantined workers."""
