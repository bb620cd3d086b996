"""Only the weight digest's fused CPU kernel lives here; everything else is in pyproject.toml.

The extension is optional: where no C compiler (or no Python headers) is present the install
still succeeds and CPU tensors are digested by torch ops instead (the same digests, ~5x
slower; `cohortgate.agent.digest.KERNEL` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cohortgate.agent._digest",
            sources=["agent/_digest.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
