"""Pallas GPU kernels (amax, low-precision casting) for low-precision weight gathering.

Nothing is exported yet: low-precision gathering (``GTPConfig.gather_format``) is not
implemented in this release.
"""
