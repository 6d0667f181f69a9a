//! CubeCL kernels and their `FusedOps` wiring for the CubeCL backends.
