# SPDX-License-Identifier: Apache-2.0
"""The GDN kernel-race diagnostic's own logic (``tests/gpu/gdn_kernel_race.py``): what it calls the same
output, and an autotuner pinned to one config at a time and given back as it was."""

from types import SimpleNamespace

import torch

from tests.gpu.gdn_kernel_race import _add_to_class, _pinned, _same_bits


def test_same_bits_is_bit_for_bit():
    x = torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)
    assert not torch.equal(x, x.clone())  # NaN != NaN: a value comparison would call every NaN run distinct
    assert _same_bits(x, x.clone())
    assert not _same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not _same_bits(torch.tensor([1.0]), torch.tensor([1.0]).nextafter(torch.tensor([2.0])))


def test_a_pinned_autotuner_gets_its_own_configs_and_choices_back():
    a, b = object(), object()
    configs, cache = [a, b], {"shape": a}
    tuner = SimpleNamespace(configs=configs, cache=cache)
    with _pinned(tuner) as (listed, pin):
        assert listed == [a, b]
        pin(b)
        assert tuner.configs == [b] and tuner.cache == {}
        tuner.cache["shape"] = b  # the pinned run's choice
    assert tuner.configs is configs and tuner.cache is cache and cache == {"shape": a}


def test_configs_are_filed_by_the_bits_of_their_output():
    a, b = torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])
    outs, members = [], []
    for out, cfg in ((a, "c0"), (b, "c1"), (a.clone(), "c2"), (-b * -1, "c3")):
        _add_to_class(outs, members, out, cfg)
    assert len(outs) == 2 and members == [["c0", "c2"], ["c1", "c3"]]
