"""The slot engine's scheduling decisions (`xlagen.serving.schedule`), without TensorFlow or a model."""

from __future__ import annotations

import pytest

from xlagen.serving import schedule


def test_several_steps_per_call_only_while_nothing_waits_for_a_slot():
    assert schedule.steps_per_call(4, waiting=False, free_slots=3, chunking=False, tokens_left=[10, 4]) == 4
    assert schedule.steps_per_call(4, waiting=True, free_slots=3, chunking=False, tokens_left=[10]) == 1
    # A request waits, but no slot could take it before the next step: the step may run 4 tokens.
    assert schedule.steps_per_call(4, waiting=True, free_slots=0, chunking=False, tokens_left=[10]) == 4
    assert schedule.steps_per_call(4, waiting=False, free_slots=3, chunking=True, tokens_left=[10]) == 1
    assert schedule.steps_per_call(4, waiting=False, free_slots=3, chunking=False, tokens_left=[10, 3]) == 1
    assert schedule.steps_per_call(1, waiting=False, free_slots=3, chunking=False, tokens_left=[10]) == 1


def test_the_step_width_holds_every_active_slot():
    assert schedule.step_width((1, 4, 16), {0}) == 1
    assert schedule.step_width((1, 4, 16), {0, 3}) == 4
    assert schedule.step_width((1, 4, 16), {4}) == 16


def test_compaction_packs_the_highest_slots_into_the_lowest_free_ones():
    assert schedule.compaction((1, 4, 16), {15}) == [(15, 0)]
    assert schedule.compaction((1, 4, 16), {1, 9, 12}) == [(12, 0), (9, 2)]
    assert schedule.compaction((1, 4, 16), {0, 2}) == []  # width 4 holds them already
    assert schedule.compaction((1, 4, 16), {0, 5, 6, 7, 8}) == []  # no narrower width holds five
    # A slot reserved for a prompt in chunks counts as taken and is never a target.
    assert schedule.compaction((1, 4, 16), {9}, reserved=0) == [(9, 1)]
    assert schedule.compaction((1, 4, 16), {9, 10, 11}, reserved=1) == [(11, 0), (10, 2), (9, 3)]


def test_chunks_start_at_the_first_real_token_and_the_last_ends_the_bucket():
    assert schedule.chunk_offsets(32, 25, 8) == [0, 8, 16, 24]
    assert schedule.chunk_offsets(32, 20, 8) == [8, 16, 24]
    assert schedule.chunk_offsets(1023, 1000, 256) == [0, 256, 512, 767]
    assert schedule.chunk_offsets(1023, 300, 256) == [512, 767]
    for bad in ((32, 25, 32), (32, 0, 8), (32, 40, 8)):
        with pytest.raises(ValueError):
            schedule.chunk_offsets(*bad)


def test_the_slots_shift_only_when_a_step_would_not_fit():
    assert schedule.shift_amount(index=100, steps=4, length=104, starts=[90], start_column=16) == 0
    assert schedule.shift_amount(index=101, steps=4, length=104, starts=[90, 50], start_column=16) == 50
    assert schedule.shift_amount(index=101, steps=4, length=104, starts=[95], start_column=16) == 85


def test_the_schedule_needs_no_tensorflow():
    import subprocess
    import sys

    code = "import sys; import xlagen.serving.schedule; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
