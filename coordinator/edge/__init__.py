"""Protobuf and the network at the edge.

gRPC servicers, request validation, server assembly, HTTP, the relay and the settings.
"""
