"""Canaries (invariant 7): marker traffic, the incident's reproduction, the handoff contract, ledger
integrity, live worker configuration, and a self-test that replays the incident in a sandbox."""
