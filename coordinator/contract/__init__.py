"""The torch-free contract shared by agent and coordinator.

Manifests, layouts, digests, diffs, addresses, errors and limits: nothing here imports
torch, protobuf, grpc or any other part of the coordinator.
"""
