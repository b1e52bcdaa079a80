# SPDX-License-Identifier: Apache-2.0
"""What the tests and the benchmarks both run on: PCP groups of processes (``dist``), engines with
every rank on one GPU (``shared_gpu``), the unsplit GDN core (``gdn_unsplit``) and inputs of the
published model's layer shapes (``layer_inputs``). Not shipped with the package."""
