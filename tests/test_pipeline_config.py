"""Job configuration and input planning without Ray or a model: flags against files, bad settings and files,
shards from folders, globs and Hugging Face datasets, column checks, and the CLI failing before Ray starts."""

from __future__ import annotations

import argparse
import random

import pyarrow as pa
import pytest

from jobs.generate import add_arguments, main, text_flag
from pipeline.config import JobConfig, build, load_yaml
from pipeline.io import plan_input
from tests.pipeline_cases import fake_actor, write

# --- config ---


def test_flags_override_file(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text('output: out/\nmax-new-tokens: 8\nkivi: false\nstop: ["\\n"]\n')
    job = build(load_yaml(f), {"max_new_tokens": 4})
    assert (job.output, job.max_new_tokens, job.kivi, job.stop) == ("out/", 4, False, ("\n",))
    assert job.kivi_config() is None
    assert not job.ignore_eos and not job.sampling_defaults().ignore_eos


def test_ignore_eos_from_file_flag_and_row(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("output: out/\nignore_eos: true\n")
    assert build(load_yaml(f), {}).sampling_defaults().ignore_eos
    assert not build(load_yaml(f), {"ignore_eos": False}).ignore_eos
    actor = fake_actor(ignore_eos=True)
    assert actor.sampling_defaults.ignore_eos
    batch = pa.table({"prompt": ["a b", "c d"], "sampling_params": [None, '{"ignore_eos": false}']})
    actor(batch)
    assert [r.sampling.ignore_eos for r in actor.engine.seen] == [True, False]
    with pytest.raises(ValueError, match="ignore_eos"):
        build({}, {"output": "o", "ignore_eos": "yes"})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert vars(parser.parse_args(["--output", "o", "--ignore-eos"]))["ignore_eos"] is True
    assert vars(parser.parse_args(["--no-ignore-eos"]))["ignore_eos"] is False


def test_text_flags_read_shell_escapes():
    """--prompt-template and --stop typed in a shell's quotes: \\n is a newline, \\t a tab, \\\\ a backslash (a
    template typed as in the README must not reach the model with a literal backslash-n); other backslashes stay."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = vars(parser.parse_args(["--prompt-template", r"Context: {context}\nQuestion: {q}\tA:", "--stop", r"\n",
                                   "--stop", r"a\b"]))
    assert args["prompt_template"] == "Context: {context}\nQuestion: {q}\tA:"
    assert args["stop"] == ["\n", "a\\b"]
    rng = random.Random()
    for _ in range(50):  # any text survives being typed with its escapes spelled out
        text = "".join(rng.choice("ab{}\n\t\\ ") for _ in range(rng.randint(0, 30)))
        typed = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
        assert text_flag(typed) == text


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"output": "o", "kv_bits": 3}, "kv_bits"),
        ({"output": "o", "group_size": 24}, "group_size"),
        ({"output": "o", "residual_length": 40}, "residual_length"),
        ({"output": "o", "kv_scale_dtype": "bfloat16"}, "kv_scale_dtype"),
        ({"output": "o", "temperature": -1.0}, "temperature"),
        ({"output": "o", "top_p": 0.0}, "top_p"),
        ({"output": "o", "batch_size": 0}, "batch_size"),
        ({"output": "o", "actors": 0}, "actors"),
        ({"output": "o", "gpus_per_actor": 0}, "gpus_per_actor"),
        ({"output": "o", "gpus_per_actor": 1.5}, "gpus_per_actor"),
        ({"output": "o", "growth_plan_share": 0.0}, "growth_plan_share"),
        ({"output": "o", "max_new_tokens": "16"}, "max_new_tokens"),
        ({"output": "o", "prompt_template": "no fields"}, "prompt_template"),
        ({"output": "o", "gguf_file": "x.gguf"}, "gguf_file"),
        ({"output": "o", "colour": "red"}, "colour"),
        ({}, "output"),
    ],
)
def test_bad_settings_name_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        build({}, settings)


def test_bad_yaml_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_yaml(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="cannot read"):
        load_yaml(tmp_path / "missing.yaml")
    n, m = random.sample(range(1, 100), 2)  # one setting under both spellings: refused, whichever comes last
    (tmp_path / "twice.yaml").write_text(f"output: o\nmax_new_tokens: {n}\nmax-new-tokens: {m}\n")
    with pytest.raises(ValueError, match="sets 'max_new_tokens' twice"):
        load_yaml(tmp_path / "twice.yaml")
    (tmp_path / "once.yaml").write_text(f"output: o\nmax-new-tokens: {m}\n")
    assert load_yaml(tmp_path / "once.yaml") == {"output": "o", "max_new_tokens": m}


# --- input planning ---


def test_folder_and_glob_shards(tmp_path):
    write(str(tmp_path / "in/a.parquet"), prompt=["x", "y"], topic=["t", "u"])
    write(str(tmp_path / "in/sub/b.parquet"), prompt=["z"], topic=["v"])
    write(str(tmp_path / "in/_skip/c.parquet"), prompt=["z"], topic=["v"])
    plan = plan_input(JobConfig(output="o", input=str(tmp_path / "in")))
    assert [(s.name, s.num_rows) for s in plan.shards] == [("a", 2), ("sub__b", 1)]
    assert (plan.source, plan.has_id, plan.passthrough()) == ("prompt", False, ["topic"])
    plan = plan_input(JobConfig(output="o", input=str(tmp_path / "in/sub/*.parquet")))
    assert [s.name for s in plan.shards] == ["b"]


def test_colliding_shard_names_fail_at_planning(tmp_path):
    write(str(tmp_path / "in/a/b.parquet"), prompt=["x"])
    write(str(tmp_path / "in/a__b.parquet"), prompt=["y"])
    with pytest.raises(ValueError, match="both map to shard 'a__b'"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "in")))


def test_model_checked_before_ray(tmp_path):
    """An unsupported architecture or a group size that does not divide head_dim fails at planning."""
    from transformers import GPT2Config, LlamaConfig

    from pipeline.run import check_model

    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="gpt2"):
        check_model(JobConfig(output="o", model=str(tmp_path / "gpt2")))
    with pytest.raises(ValueError, match="head_dim=32"):
        check_model(JobConfig(output="o", model=str(tmp_path / "llama"), group_size=64, residual_length=128))
    check_model(JobConfig(output="o", model=str(tmp_path / "llama"), group_size=32))
    check_model(JobConfig(output="o", model=str(tmp_path / "gpt2"), kivi=False))  # the baseline runs anything


def test_hf_dataset_shards(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": list("abcde"), "n": list(range(5))}).save_to_disk(str(tmp_path / "hf"))
    plan = plan_input(JobConfig(output="o", input=str(tmp_path / "hf"), hf_shard_rows=2))
    assert plan.kind == "hf"
    assert [(s.name, s.num_rows, s.start) for s in plan.shards] == [
        ("rows-000000000-000000001", 2, 0),
        ("rows-000000002-000000003", 2, 2),
        ("rows-000000004-000000004", 1, 4),
    ]
    assert plan.shards[2].default_id(0) == "4"


@pytest.mark.parametrize(
    "columns, settings, message",
    [
        ({"text": ["x"]}, {}, "no 'prompt' or 'messages' column"),
        ({"question": ["x"]}, {"prompt_template": "{context} {question}"}, r"lacks|\['context'\]"),
        ({"prompt": ["x"], "generated_text": ["y"]}, {}, "overwrite"),
    ],
)
def test_bad_columns_fail_at_planning(tmp_path, columns, settings, message):
    path = write(str(tmp_path / "in.parquet"), **columns)
    with pytest.raises(ValueError, match=message):
        plan_input(JobConfig(output="o", input=path, **settings))


def test_unreadable_inputs(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "nope.parquet")))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read parquet file .*junk.parquet"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "junk.parquet")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty' holds no .parquet files"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match=r"zz\*\.parquet' matches no .parquet files"):
        plan_input(JobConfig(output="o", input=str(tmp_path / "zz*.parquet")))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-new-tokens", "many"], "invalid int value"),
        (["--kv-bits", "3"], "kv_bits"),
        (["--input", "/nonexistent/x.parquet"], "not found"),
        (["--input", "NO_PROMPT"], "no 'prompt' or 'messages' column"),
        (["--input", "NO_PROMPT", "--prompt-template", "{question}"], "needs columns ['question']"),
        (["--model", "./no-such-model"], "model folder"),
        (["--model", "NO_PROMPT"], "is a file: give a model folder or a .gguf file"),  # an existing non-model file
    ],
)
def test_cli_fails_before_ray(tmp_path, capsys, argv, message):
    import ray

    no_prompt = write(str(tmp_path / "in.parquet"), text=["hello"])
    with pytest.raises(SystemExit) as e:
        code = main(["--output", str(tmp_path / "out"), *(no_prompt if a == "NO_PROMPT" else a for a in argv)])
        raise SystemExit(code)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not ray.is_initialized()
