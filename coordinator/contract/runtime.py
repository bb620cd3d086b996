"""The runtime facts a rank reports with its join (JoinRequest.runtime), in report order."""

RUNTIME_FIELDS = (
    "torch_version",
    "cuda_version",
    "nccl_version",
    "device_type",
    "device_name",
    "device_capability",
)
