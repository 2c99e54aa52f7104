"""Grouping a batch's prompts by shared prefix (`openk2.llm.hf_prefix.plan_prefixes`) and batch picking."""

from __future__ import annotations

from openk2.llm.hf_backend import _Plan, pick_batch
from openk2.llm.hf_prefix import common_prefix, plan_prefixes


def test_groups_share_their_longest_common_head():
    a = list(range(40)) + [100, 101]
    b = list(range(40)) + [200]
    c = list(range(30)) + [300, 301, 302]
    d = [7, 8, 9]
    assert plan_prefixes([a, b, d], min_shared=16).cut == [40, 40, 0]
    plan = plan_prefixes([a, b, c, d], min_shared=16)
    assert plan.group[0] == plan.group[1] != -1
    assert plan.group[3] == -1 and plan.cut[3] == 0  # nothing in common: no prefix
    # c joins a and b only if that does not lower what the group saves: 3 * 30 >= 2 * 40
    assert plan.group[2] == plan.group[0] and plan.cut[2] == 30 and plan.cut[0] == 30
    assert plan.shared_tokens == 3 * 30 - 30
    e = list(range(17)) + [999]  # sorts last; joining would cut the group's head from 30 to 17: 4 * 17 < 3 * 30
    assert plan_prefixes([a, b, c, e], min_shared=16).group[3] == -1


def test_every_row_keeps_a_token_of_its_own_and_short_heads_are_not_shared():
    same = list(range(20))
    plan = plan_prefixes([same, same, same], min_shared=16)
    assert plan.cut == [19, 19, 19]  # identical prompts: the last token is each row's own
    assert plan_prefixes([list(range(10)) + [1], list(range(10)) + [2]], min_shared=16).group == [-1, -1]
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def _plan(prompt: list[int], temperature: float = 0.7) -> _Plan:
    return _Plan(prompt=prompt, tools=None, grammar=None, n=1, temperature=temperature, top_p=None, top_k=None,
                 seed=None, stops=[], max_tokens=8)


def test_pick_batch_keeps_the_oldest_and_prefers_its_prefix():
    queue = [(_plan([1, 2, 3, 4]), "head"), (_plan([9, 9]), "other"), (_plan([1, 2, 3, 5]), "near"),
             (_plan([1, 2, 3, 4], temperature=0.0), "greedy"), (_plan([1, 2, 7]), "some")]
    assert [x for _, x in pick_batch(queue, 3)] == ["head", "near", "some"]
    assert [x for _, x in pick_batch(queue, 10)] == ["head", "near", "some", "other"]  # never mixes sampling keys


def test_one_long_rest_is_prefilled_alone_not_padded_into_every_row():
    from openk2.llm.hf_prefix import batched_rest_width

    assert batched_rest_width([5] * 31 + [400]) == 5  # 31 x 5 padded + 395 + overhead alone << 32 x 400
    assert batched_rest_width([50, 52, 55]) == 55  # alike: one padded prefill is cheapest
    assert batched_rest_width([7]) == 7
    assert batched_rest_width([10, 200], overhead=0) == 10 and batched_rest_width([10, 20], overhead=48) == 20
