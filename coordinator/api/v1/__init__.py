"""Generated gRPC stubs for cohortgate.v1 (see proto/ and scripts/gen_proto.py)."""
