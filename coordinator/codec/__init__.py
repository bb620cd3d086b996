"""Agent-safe proto <-> contract conversion and the client's channel settings.

Imports only the contract and the generated stubs, so a rank that joins loads no decision,
state or service code.
"""
