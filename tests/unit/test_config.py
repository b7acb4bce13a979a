import pytest

from lorasync.config import load_config, parse_options
from lorasync.errors import ConfigError, LorasyncError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_are_the_embedded_job():
    c = load_config()
    assert c.model.name == "smollm2-135m"
    assert (c.lora.r, c.lora.alpha) == (8, 16.0)
    assert c.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert c.comm.strategy == "auto" and c.run.nproc == 2 and c.data.path == "demo"


def test_yaml_then_overrides(tmp_path):
    c = load_config(write(tmp_path, "train: {lr: 0.01, max_steps: 7}\nlora: {r: 4}\n"),
                    {"train": {"max_steps": "9"}})
    assert c.train.lr == 0.01 and c.train.max_steps == 9 and c.lora.r == 4


@pytest.mark.parametrize("text, field, hint", [
    ("trian: {lr: 0.1}\n", "c.yaml: unknown key 'trian'", "did you mean 'train'"),
    ("train: {lrate: 0.1}\n", "train: unknown key 'lrate'", "did you mean 'lr'"),
    ("train: {lr: fast}\n", "train.lr", "use a number"),
    ("train: {batch_size: 0}\n", "train.batch_size", ">= 1"),
    ("lora: {dropout: 1.5}\n", "lora.dropout", "[0, 1)"),
    ("train: {schedule: wavy}\n", "train.schedule", "constant, linear or cosine"),
    ("run: {backend: mpi}\n", "run.backend", "auto, gloo or nccl"),
    ("- just\n- a list\n", "c.yaml", "mapping of sections"),
    ("comm: {cross_node: ring}\n", "comm.cross_node", "use auto, leaders or shards"),
    ("comm: {hierarchy: tree}\n", "comm.hierarchy", "use auto, flat or node"),
    ("comm: {allreduce_algo: tree}\n", "comm.allreduce_algo",
     "use ring, recursive_doubling or auto"),
    ("comm: {strategy: int8, cross_node: shards}\n", "comm.cross_node",
     "shards apply to local and diloco (and auto's), not int8"),
])
def test_bad_yaml_names_field_and_fix(tmp_path, text, field, hint):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert field in str(e.value) and hint in str(e.value)


def test_yaml_syntax_error_names_line(tmp_path):
    with pytest.raises(LorasyncError, match=r"c.yaml:\d+: not valid YAML"):
        load_config(write(tmp_path, "train:\n  lr: [1,\n"))


def test_missing_config_file():
    with pytest.raises(ConfigError, match="file not found"):
        load_config("/nonexistent/c.yaml")


def test_comm_options_parse_as_yaml_scalars():
    assert parse_options(["period=8", "ratio=0.01", "streaming=true"]) == {
        "period": 8, "ratio": 0.01, "streaming": True}
    with pytest.raises(ConfigError, match="key=value"):
        parse_options(["period"])


def test_targets_accept_comma_string():
    c = load_config(None, {"lora": {"targets": "q_proj, v_proj"}})
    assert c.lora.targets == ["q_proj", "v_proj"]


def test_steps_or_epochs_required():
    with pytest.raises(ConfigError, match="max_steps"):
        load_config(None, {"train": {"max_steps": 0}})
    assert load_config(None, {"train": {"max_steps": 0, "epochs": 1.5}}).train.epochs == 1.5
