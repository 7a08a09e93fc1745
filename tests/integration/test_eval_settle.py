"""A complete evaluation round is summarised once for good and its per-prompt results leave Redis
(broker/prompts/evals.py ``EvalHistory.settle``): a run's evaluation then costs one summary per round,
not one stream entry per prompt per round. Every reader (the dashboard's, ``relay up``'s progress line,
``summary.json``'s read from scratch) must see the same numbers before and after. Real redis-server."""

import json

import redis

from broker.client import queues
from broker.prompts.evals import EvalHistory, history_for_summary
from broker.protocol.keys import Keys
from broker.protocol.messages import EvalCompletion, EvalResult, EvalRound, encode_eval_result


def _round(r, keys, v, prompts=3, samples=2):
    r.hset(
        keys.eval_rounds,
        str(v),
        EvalRound(version=v, prompts=prompts, greedy=True, samples=samples, threshold=1.0).encode(),
    )


def _answer(r, keys, v, idx, reward, version=None):
    pipe = r.pipeline()
    c = lambda x: EvalCompletion(reward=x, status="ok", length=4)  # noqa: E731
    queues.add_eval_result(
        pipe,
        keys,
        v,
        idx,
        encode_eval_result(
            EvalResult(version=version or v, generator="g0", greedy=c(reward), samples=[c(reward), c(0.0)])
        ),
    )
    pipe.execute()


def test_a_complete_round_keeps_its_summary_and_loses_its_per_prompt_results(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("ev")
    _round(r, keys, 10)
    _round(r, keys, 20)
    for i, reward in enumerate((1.0, 0.0, 1.0)):
        _answer(r, keys, 10, i, reward)
    _answer(r, keys, 10, 1, 1.0)  # prompt 1 answered twice (reclaimed): the first answer counts
    _answer(r, keys, 20, 0, 1.0)  # round 20: one prompt of 3 answered so far
    dashboard, broker = EvalHistory(r, keys), EvalHistory(r, keys, settler=True)
    before = dashboard.rounds()
    assert [s["round"] for s in before] == [10, 20] and before[0]["complete"] and not before[1]["complete"]
    assert before[0]["pass@1"] == 2 / 3

    assert broker.settle() == [10]  # the incomplete round keeps its results
    left = queues.read_eval_results(r, keys)
    assert [int(f[b"round"]) for _, f in left] == [20]
    assert json.loads(r.hget(keys.eval_summaries, "10")) == before[0]
    assert dashboard.rounds() == before  # a reader that had read the results
    assert history_for_summary(r, keys) == before  # and one reading from scratch (summary.json)

    _answer(r, keys, 10, 2, 0.0)  # a late answer to the settled round: deleted, the summary unchanged
    _answer(r, keys, 20, 1, 0.0)
    _answer(r, keys, 20, 2, 0.0)
    assert broker.settle() == [20]
    assert queues.read_eval_results(r, keys) == []
    after = history_for_summary(r, keys)
    assert after[0] == before[0] and after[1]["complete"] and after[1]["pass@1"] == 1 / 3
    assert dashboard.rounds() == after and broker.settle() == []


def test_an_unreadable_summary_is_skipped_and_counted(redis_url):
    r, keys = redis.Redis.from_url(redis_url), Keys("ev2")
    _round(r, keys, 5, prompts=1)
    _answer(r, keys, 5, 0, 1.0)
    _round(r, keys, 6, prompts=1)
    r.hset(keys.eval_summaries, "6", "{not json")
    h = EvalHistory(r, keys)
    rounds = h.rounds()
    assert [s["round"] for s in rounds] == [5, 6] and rounds[0]["pass@1"] == 1.0
    assert rounds[1]["n_prompts"] == 0  # its summary unreadable, its results gone: shown as unanswered
    assert h.malformed["eval_rounds"] == 1
    h.rounds()
    assert h.malformed["eval_rounds"] == 1  # counted per read, not accumulated
