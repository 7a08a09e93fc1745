"""How Ulysses sequence parallelism (learner/sequence_parallel.py) shares out the work, and what it refuses
before any exchange: the heads by key-value group over k ranks, uneven where they must be; the world's ranks in
sequence-parallel groups of k and data-parallel groups across them (world = dp × k); a model whose attention
cannot be split, named. The numbers of a split row are compared with one rank's in
tests/integration/test_sequence_parallel.py."""

import pytest
import torch

from learner import sequence_parallel
from learner.sequence_parallel import SequenceGroup, check_sequence_parallel, head_split, ulysses_attention


@pytest.mark.parametrize(
    "heads, kv, k, want",
    [
        (9, 3, 2, ([6, 3], [2, 1])),  # SmolLM2-135M over 2 ranks: whole key-value groups, uneven
        (9, 3, 3, ([3, 3, 3], [1, 1, 1])),
        (8, 8, 2, ([4, 4], [4, 4])),  # no grouping
        (14, 2, 2, ([7, 7], [1, 1])),  # Qwen2-0.5B
        (32, 8, 3, ([12, 12, 8], [3, 3, 2])),
    ],
)
def test_heads_are_shared_out_by_whole_key_value_groups(heads, kv, k, want):
    q, kvs = head_split(heads, kv, k)
    assert (q, kvs) == want and sum(q) == heads and sum(kvs) == kv


@pytest.mark.parametrize("heads, kv, k", [(9, 3, 4), (4, 1, 2), (9, 4, 2)])
def test_a_split_that_would_leave_a_rank_without_a_key_value_head_or_break_a_group_is_refused(heads, kv, k):
    with pytest.raises(ValueError, match=f"cannot be split over {k} ranks"):
        head_split(heads, kv, k)


def test_the_world_is_cut_into_sequence_groups_of_k_and_data_parallel_groups_across_them(monkeypatch):
    """world 4, k = 2: ranks {0, 1} and {2, 3} share sequences; {0, 2} and {1, 3} are the data-parallel groups.
    Every rank creates every group in the same order (``dist.new_group`` is a collective)."""
    made = []

    def new_group(ranks):
        made.append(tuple(ranks))
        return tuple(ranks)

    monkeypatch.setattr(sequence_parallel.dist, "new_group", new_group)
    seen = {}
    for rank in range(4):
        made.clear()
        g = SequenceGroup.of(rank, 4, 2)
        seen[rank] = (g.group, g.dp_group, g.rank, g.dp_rank, g.dp)
        assert made == [(0, 1), (2, 3), (0, 2), (1, 3)]
    assert seen == {
        0: ((0, 1), (0, 2), 0, 0, 2),
        1: ((0, 1), (1, 3), 1, 0, 2),
        2: ((2, 3), (0, 2), 0, 1, 2),
        3: ((2, 3), (1, 3), 1, 1, 2),
    }
    made.clear()
    one = SequenceGroup.of(1, 2, 2)  # one group: no data-parallel group
    assert made == [(0, 1)] and one.dp_group is None and one.dp == 1
    with pytest.raises(ValueError, match=r"sequence_parallel \(4\) must divide the learner's 6 ranks"):
        SequenceGroup.of(0, 6, 4)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=4)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **kw}))


def test_a_model_whose_attention_cannot_be_split_is_refused_before_any_exchange():
    """No process group exists here: the refusals come before the start-up check's collectives."""
    group = SequenceGroup(size=2, rank=0, group=None, dp_rank=0, dp=1, dp_group=None)
    assert "4 heads in 1 key-value heads cannot be split over 2 ranks" in check_sequence_parallel(
        _llama(num_attention_heads=4, num_key_value_heads=1), group
    )
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sliding = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=20,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
        )
    )
    assert check_sequence_parallel(sliding, group) == "sliding-window or soft-capped attention"


def test_the_split_attention_refuses_what_it_cannot_compute():
    q = torch.zeros(2, 4, 3, 4)  # two rows: Ulysses' attention takes one packed row
    with pytest.raises(ValueError, match="rows other than one packed row"):
        ulysses_attention(None, q, q, q, None, scaling=0.5, position_ids=torch.arange(3)[None].expand(2, 3))
    one = torch.zeros(1, 4, 3, 4)
    with pytest.raises(ValueError, match="dropout"):
        ulysses_attention(None, one, one, one, None, scaling=0.5, dropout=0.1)
