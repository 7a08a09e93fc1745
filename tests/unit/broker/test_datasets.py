"""Prompt datasets (broker/prompts/datasets.py): formats, field mapping, chat templates token for token,
too-long prompts skipped and counted, seeded order, epochs and resuming from a position."""

import json

import pytest

from broker.prompts.datasets import (
    DatasetConfig,
    DatasetError,
    DatasetSource,
    Position,
    PromptBuilder,
    chat_ids,
    read_rows,
)
from broker.protocol.codec import ProtocolError
from broker.protocol.messages import PromptEntry
from learner.tiny_model import build_tokenizer

ROWS = [{"question": f"{i}{i}{i}", "solution": f"{i}{i}{i}", "level": i % 3} for i in range(10)]
TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def tokenizer(template: bool = True):
    tok = build_tokenizer()
    if template:
        tok.chat_template = TEMPLATE
    return tok


def write_all(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text(
        "question,solution,level\n" + "".join(f"{r['question']},{r['solution']},{r['level']}\n" for r in ROWS)
    )
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))


def cfg(path, **kw):
    base = dict(
        path=str(path), prompt_field="question", reference_field="solution", metadata_fields=["level"], task="digits"
    )
    return DatasetConfig(**{**base, **kw})


def test_every_format_reads_the_same_rows(tmp_path):
    write_all(tmp_path)
    for name in ("d.jsonl", "d.parquet", "hf"):
        assert read_rows(cfg(tmp_path / name)) == ROWS, name
    csv_rows = read_rows(cfg(tmp_path / "d.csv"))  # CSV has no types: strings
    assert [r["question"] for r in csv_rows] == [r["question"] for r in ROWS]
    assert len(read_rows(cfg(tmp_path / "d.parquet", start=2, stop=5))) == 3


def test_a_missing_field_names_the_field_and_the_row(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "1"}) + "\n")
    with pytest.raises(DatasetError, match=r"row 0: no field 'solution'.*fields: question"):
        read_rows(cfg(tmp_path / "d.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:1"):
        read_rows(cfg(tmp_path / "bad.jsonl"))
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(cfg(tmp_path / "nope.parquet"))


def test_chat_template_ids_are_exactly_apply_chat_template(tmp_path):
    tok = tokenizer()
    b = PromptBuilder(cfg(tmp_path / "x", system_prompt="9"), tok)
    rec = b.build(ROWS[3])
    msgs = [{"role": "system", "content": "9"}, {"role": "user", "content": "333"}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert rec.prompt_ids == list(want) == chat_ids(tok, msgs)
    assert tok.convert_ids_to_tokens(rec.prompt_ids) == ["<bos>", "9", "<bos>", "3", "3", "3", "="]
    assert rec.text == "<bos>9<bos>333="
    assert rec.reference == "333" and rec.task == "digits" and rec.metadata == {"level": 0}
    f = rec.fields()
    assert json.loads(f["prompt_ids"]) == rec.prompt_ids and json.loads(f["metadata"]) == {"level": 0}
    # the messages the ids render travel with them (a multi-turn episode continues that conversation)
    assert rec.messages == msgs and PromptEntry.from_fields(f).messages == msgs
    with pytest.raises(ProtocolError, match="messages"):
        PromptEntry.from_fields({**f, "messages": '"not a list"'})


def test_messages_field_and_raw_text(tmp_path):
    row = {"msgs": [{"role": "user", "content": "12"}], "answer": "12"}
    rec = PromptBuilder(
        cfg(tmp_path, messages_field="msgs", reference_field="answer", metadata_fields=[]), tokenizer()
    ).build(row)
    assert tokenizer().convert_ids_to_tokens(rec.prompt_ids) == ["<bos>", "1", "2", "="]
    raw = PromptBuilder(cfg(tmp_path, chat_template="never"), tokenizer()).build({**ROWS[1], "question": "11="})
    assert raw.text == "11=" and raw.prompt_ids == tokenizer()("11=")["input_ids"]  # one BOS, from the tokenizer
    with pytest.raises(DatasetError, match="no chat template"):
        PromptBuilder(cfg(tmp_path, chat_template="always"), tokenizer(template=False))


def test_too_long_prompts_are_skipped_and_counted_never_truncated(tmp_path):
    rows = [{"question": "1" * n, "solution": "", "level": 0} for n in (2, 9, 3, 12, 1)]
    src = DatasetSource(cfg(tmp_path, max_prompt_tokens=6, shuffle=False, epochs=1), tokenizer(), rows=rows)
    got, pos = src.take(10, Position())
    assert [rec.text for _, _, rec in got] == ["<bos>11=", "<bos>111=", "<bos>1="]
    assert all(len(rec.prompt_ids) <= 6 for _, _, rec in got)
    assert pos.skipped == 2 and pos.fed == 3 and src.exhausted(pos)
    with pytest.raises(DatasetError, match="every prompt"):
        DatasetSource(cfg(tmp_path, max_prompt_tokens=1), tokenizer(), rows=rows).take(1, Position())


def test_seeded_shuffle_epochs_and_resume_from_any_position(tmp_path):
    c = cfg(tmp_path, seed=7, epochs=3)
    src = DatasetSource(c, tokenizer(), rows=ROWS)
    whole, end = src.take(1000, Position())
    assert len(whole) == 30 and end.epoch == 3 and src.exhausted(end)
    for e in range(3):  # each epoch is a permutation of every row, and epochs differ
        assert sorted(row for ep, row, _ in whole if ep == e) == list(range(10))
    assert [r for ep, r, _ in whole if ep == 0] != [r for ep, r, _ in whole if ep == 1]
    again, _ = DatasetSource(c, tokenizer(), rows=ROWS).take(1000, Position())
    assert [(e, r) for e, r, _ in again] == [(e, r) for e, r, _ in whole]  # same seed, same order
    # resuming in pieces from stored positions (what a restarted feeder does) gives the same sequence
    pieces, pos = [], Position()
    for k in (4, 7, 1, 9, 100):
        fresh = DatasetSource(c, tokenizer(), rows=ROWS)
        got, pos = fresh.take(
            k, Position.from_fields({key.encode(): str(v).encode() for key, v in pos.as_fields().items()})
        )
        pieces += got
    assert [(e, r) for e, r, _ in pieces] == [(e, r) for e, r, _ in whole]
    unshuffled, _ = DatasetSource(cfg(tmp_path, shuffle=False, epochs=1), tokenizer(), rows=ROWS).take(100, Position())
    assert [r for _, r, _ in unshuffled] == list(range(10))


def test_start_past_the_end_says_how_many_rows_there_are(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(i), "answer": str(i)}) + "\n" for i in range(5)))
    with pytest.raises(DatasetError, match=r"has 5 rows, so dataset.start = 7 leaves none: use a start below 5"):
        read_rows(DatasetConfig(path=str(path), start=7))
