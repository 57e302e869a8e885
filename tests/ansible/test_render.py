"""run.sh and the units, rendered with the PRODUCTION inventory's values, carry the original run.

The templates are rendered by Ansible itself (ansible-runner driving a small playbook with the
template module on localhost), from inventory/production, so what is asserted here is what
deploy.yml would install on CT 200.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# The hand-run command line the service replaces (docs/contracts.md). run.sh must mean the same run:
# both are parsed by the trainer's own parser and compared, so neither the flags it spells out nor the
# trainer defaults it leaves to are restated here. One exception: the hand-run predates --loss and left it
# to the default of its day, CE; the default is ce+dpace since 2026-12-06, so `--loss ce` is spelled out.
ORIGINAL_RUN = (
    "--target-model /dev/shm/Qwen3.6-27B --data-dir /workspace/tokenized_completions "
    "--output-dir /workspace/checkpoints --target-gpus 0,1,2,3,4 --drafter-gpus 5,6,7 --epochs 6 --lr 6e-4 "
    "--warmup-ratio 0.04 --weight-decay 0.01 --grad-accum 4 --grad-clip 1.0 --token-budget 49152 "
    "--max-seq-len 8192 --max-batch-size 64 --block-size 32 --max-anchors 1024 --num-draft-layers 5 "
    "--gamma 10.0 --noise-start 0.05 --noise-end 0.01 --noise-type uniform --use-soft-labels --loss ce")


def exec_args(run_sh: str) -> list[str]:
    """The argv of the final `exec` line (backslash continuations joined)."""
    joined = run_sh.replace("\\\n", " ")
    line = next(l for l in joined.splitlines() if l.lstrip().startswith("exec "))
    return shlex.split(line)


def test_run_sh_is_strict_bash(rendered):
    text = (rendered / "run.sh").read_text()
    assert text.startswith("#!/bin/bash\n")
    assert "\nset -euo pipefail\n" in text
    subprocess.run(["bash", "-n", str(rendered / "run.sh")], check=True)


def test_run_sh_sets_the_allocator_before_the_trainer_starts(rendered):
    text = (rendered / "run.sh").read_text()
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n" in text
    assert text.index("PYTORCH_CUDA_ALLOC_CONF") < text.index("exec ")
    assert 'export DFLASH_PROFILE_INTERVAL="${DFLASH_PROFILE_INTERVAL:-60}"' in text


def test_run_sh_leaves_a_flight_recorder_dump_and_keeps_nvls_off(rendered):
    """A hang on NCCL must leave each rank's last ops in the output dir, and NVLink multicast stays off."""
    env = dict(re.findall(r"^export (\w+)=(\S+)$", (rendered / "run.sh").read_text(), re.M))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    # the buffer under its new name and the old one (all that older torch reads), one value
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == env["TORCH_FR_BUFFER_SIZE"]
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith("/workspace/checkpoints/")
    assert env["NCCL_NVLS_ENABLE"] == "0"


def test_run_sh_keeps_the_kernel_caches_out_of_tmp(rendered):
    """Triton's and inductor's caches (FLA's autotune results among them) under the service's home, which a
    reboot keeps; torch's default is /tmp, emptied at boot."""
    env = dict(re.findall(r"^export (\w+)=(\S+)$", (rendered / "run.sh").read_text(), re.M))
    assert env["TRITON_CACHE_DIR"] == "/opt/dflash/kernel-cache/triton"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/opt/dflash/kernel-cache/inductor"


def test_run_sh_bounds_the_compile_workers(rendered):
    """Inductor's compile workers per rank: the container's cores (the provision role's) shared among this
    node's ranks (one per GPU of either list), so the warmup's compiles never start more workers than cores."""
    import yaml
    env = dict(re.findall(r"^export (\w+)=(\S+)$", (rendered / "run.sh").read_text(), re.M))
    cores = yaml.safe_load((REPO / "roles/dflash_provision/defaults/main.yml").read_text())["dflash_provision_cores"]
    args = exec_args((rendered / "run.sh").read_text())
    gpus = {g for flag in ("--target-gpus", "--drafter-gpus") for g in args[args.index(flag) + 1].split(",")}
    threads = int(env["TORCHINDUCTOR_COMPILE_THREADS"])
    assert threads == max(1, cores // len(gpus))
    assert 1 <= threads * len(gpus) <= cores


def test_run_sh_execs_the_trainer_unbuffered_from_the_venv(rendered):
    argv = exec_args((rendered / "run.sh").read_text())
    assert argv[:4] == ["exec", "/opt/dflash/venv/bin/python", "-u", "-m"]
    assert argv[4] == "trainer"
    assert argv[-1] == "$@", "extra arguments (--check-config) must reach the trainer"


def test_run_sh_is_the_original_run(rendered):
    from trainer.config.options import parse_args
    argv = exec_args((rendered / "run.sh").read_text())[5:-1]
    assert parse_args(argv) == parse_args(ORIGINAL_RUN.split())


def test_run_sh_spells_each_flag_once(rendered):
    flags = [a for a in exec_args((rendered / "run.sh").read_text()) if a.startswith("--")]
    assert len(flags) == len(set(flags)), flags


def test_run_sh_has_no_secret_and_no_wandb_without_a_key(rendered):
    text = (rendered / "run.sh").read_text()
    assert "WANDB_API_KEY=" not in text
    assert "--wandb-mode" not in text


def unit_settings(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_unit_is_a_notify_service_with_a_watchdog_and_graceful_stop(rendered):
    s = unit_settings(rendered / "dflash.service")
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["main"]
    assert s["ExecStart"] == ["/opt/dflash/run.sh"]
    assert int(s["WatchdogSec"][0]) > 0
    assert s["Restart"] == ["on-failure"]
    assert int(s["RestartSec"][0]) > 0
    assert int(s["StartLimitBurst"][0]) > 0 and int(s["StartLimitIntervalSec"][0]) > 0
    assert s["KillMode"] == ["mixed"]
    assert int(s["TimeoutStopSec"][0]) >= 300, "long enough for a checkpoint"
    assert int(s["TimeoutStartSec"][0]) >= 1800, "long enough to load a 27B target"
    assert s["LimitMEMLOCK"] == ["infinity"]
    assert s["EnvironmentFile"] == ["-/etc/default/dflash"]
    assert s["RestartPreventExitStatus"] == ["2 3"]   # bad input; a start-up stall (launch.STALL_EXIT)
    assert "PYTHONFAULTHANDLER=1" in s["Environment"], "a watchdog abort must leave a Python stack in the journal"
    assert s["LimitCORE"] == ["0"]


def test_environment_file_values_are_quoted_for_systemd(tmp_path):
    """systemd splits an unquoted EnvironmentFile value at whitespace and takes '#' for a comment."""
    sys.path.insert(0, str(REPO / "roles/dflash_service/filter_plugins"))
    try:
        from dflash_service import dflash_service_argv, dflash_service_env_quote
    finally:
        sys.path.pop(0)
    assert dflash_service_env_quote('a b #c "d" $HOME') == '"a b #c \\"d\\" \\$HOME"'
    with pytest.raises(ValueError):
        dflash_service_env_quote("two\nlines")
    assert dflash_service_argv({"target_gpus": "0,1", "use_soft_labels": False, "target_layers": [1, 9],
                                "max_steps": None, "wandb_mode": ""}) == [
        "--target-gpus", "0,1", "--no-use-soft-labels", "--target-layers", "1,9"]


def test_unit_requires_and_follows_the_staging_unit(rendered):
    s = unit_settings(rendered / "dflash.service")
    assert "dflash-stage-weights.service" in s["Requires"]
    assert "dflash-stage-weights.service" in s["After"]
    stage = unit_settings(rendered / "dflash-stage-weights.service")
    assert stage["Type"] == ["oneshot"]
    assert stage["Before"] == ["dflash.service"]
    assert "--source /workspace/models/Qwen3.6-27B --dest /dev/shm/Qwen3.6-27B" in stage["ExecStart"][0]


def _yaml_files(*globs):
    import yaml
    for g in globs:
        for p in sorted(REPO.glob(g)):
            yield p, yaml.safe_load(p.read_text()) or []


def _tasks(items):
    for t in items or []:
        if isinstance(t, dict):
            yield t
            for key in ("block", "rescue", "always", "tasks"):
                yield from _tasks(t.get(key))


def test_one_handler_topic_owned_by_the_service_role():
    """Across roles, a notify names the service role's one topic, `restart dflash`, and only its handler
    listens to it; any other notify is a role's own handler."""
    listeners: dict[str, set] = {}
    for p, items in _yaml_files("roles/*/handlers/main.yml"):
        for h in items:
            listeners.setdefault(p.parts[-3], set()).add(h.get("listen"))
    assert [r for r, topics in listeners.items() if "restart dflash" in topics] == ["dflash_service"]
    assert listeners["dflash_service"] == {"restart dflash"}
    for p, items in _yaml_files("roles/*/tasks/*.yml"):
        role = p.parts[-3]
        for t in _tasks(items):
            for n in [t["notify"]] if isinstance(t.get("notify"), str) else t.get("notify") or []:
                assert n == "restart dflash" or n in listeners.get(role, set()), (p, n)


def test_restart_stop_status_are_entry_points_of_the_service_role():
    for name in ("restart", "stop", "status"):
        plays = [t for _, items in _yaml_files(f"playbooks/{name}.yml") for play in items for t in _tasks(play.get("tasks"))]
        roles = [t["ansible.builtin.include_role"] for t in plays if "ansible.builtin.include_role" in t]
        assert roles == [{"name": "dflash_service", "tasks_from": name}], plays
    assert not (REPO / "roles/dflash_service/tasks/noop.yml").exists()


SPEC_CHECK = """
- name: Check trainer flags against the service role's argument_specs
  hosts: all
  gather_facts: false
  tasks:
    - name: Validate
      ansible.builtin.validate_argument_spec:
        argument_spec: "{{ (lookup('file', repo ~ '/roles/dflash_service/meta/argument_specs.yml') | from_yaml).argument_specs.main.options }}"
        provided_arguments:
          dflash_service_target_gpus: cpu
          dflash_service_drafter_gpus: cpu
          dflash_service_trainer_flags: "{{ flags }}"
"""


def play_cases(tmp_path, play: str, cases: list[dict], *args: str, **env: str) -> dict:
    """One ansible-playbook run of `play` with a host per case (case0, case1, ...: local connections, each
    case's variables its host variables, where a run of its own had them as extra vars; no role's vars/
    sets any of them). Returns host -> (failed tasks, the whitespace-folded text of its results' msg,
    stdout and stderr), read from the json callback."""
    import json
    hosts = {f"case{i}": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **c}
             for i, c in enumerate(cases)}
    (tmp_path / "cases.json").write_text(json.dumps({"all": {"hosts": hosts}}))
    (tmp_path / "play.yml").write_text(play)
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), PATH=f"{BIN}:{os.environ.get('PATH', '')}",
               ANSIBLE_NOCOLOR="1", ANSIBLE_STDOUT_CALLBACK="ansible.builtin.json", **env)
    r = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(tmp_path / "cases.json"), str(tmp_path / "play.yml"),
                        *args], capture_output=True, text=True, env=env, cwd=REPO)
    out = json.loads(r.stdout[r.stdout.index("{"):])
    texts = {h: [] for h in hosts}
    for task in (t for p in out["plays"] for t in p["tasks"]):
        for h, res in task["hosts"].items():
            texts[h] += [str(res[k]) for k in ("msg", "stdout", "stderr") if res.get(k)]
    assert set(out["stats"]) == set(hosts), (out["stats"], r.stderr[-2000:])
    return {h: (out["stats"][h]["failures"], " ".join(" ".join(texts[h]).split())) for h in hosts}


SPEC_CASES = [
    ({"block_size": 4, "use_soft_labels": False, "target_layers": [1, 2], "lr": "6e-4"}, None),
    ({"block_sise": 4}, "block_sise"),
    ({"block_size": "big"}, "block_size"),
    ({"noise_type": "pink"}, "noise_type"),
]


@pytest.fixture(scope="module")
def spec_checks(tmp_path_factory):
    """SPEC_CHECK over every case of SPEC_CASES, in one run (each case's flags its host's)."""
    import json
    return play_cases(tmp_path_factory.mktemp("spec"), SPEC_CHECK, [{"flags": f} for f, _ in SPEC_CASES],
                      "-e", json.dumps({"repo": str(REPO)}))


@pytest.mark.parametrize("case", range(len(SPEC_CASES)), ids=[str(n) for _, n in SPEC_CASES])
def test_argument_specs_reject_unknown_flags_wrong_types_and_choices_up_front(spec_checks, case):
    needle = SPEC_CASES[case][1]
    failed, text = spec_checks[f"case{case}"]
    if needle is None:
        assert failed == 0, text[-3000:]
    else:
        assert failed and needle in text, text[-3000:]


def test_run_sh_stop_timeout_is_the_units_minus_the_margin(rendered):
    """One stop budget (issue 28 item 2): TimeoutStopSec 900 in the unit, --stop-timeout 840 in run.sh."""
    assert unit_settings(rendered / "dflash.service")["TimeoutStopSec"] == ["900"]
    assert "--stop-timeout 840" in (rendered / "run.sh").read_text()


STOP_CHECK = """
- name: The deploy's up-front flag check
  hosts: all
  gather_facts: false
  tasks:
    - name: Validate
      ansible.builtin.include_role:
        name: dflash_service
        tasks_from: validate
"""

STOP_CASES = [
    ({"dflash_service_timeout_stop_s": 120}, None),                                   # derived: 60 s
    ({"dflash_service_timeout_stop_s": 120, "dflash_service_trainer_flags": {"stop_timeout": 840}},
     "stop_timeout 840.0 s does not fit in TimeoutStopSec=120 s (dflash_service_timeout_stop_s): systemd kills "
     "the unit at TimeoutStopSec, so the trainer's stop timeout must be at most 60 s"),
    ({"dflash_service_timeout_stop_s": 50}, "stop_timeout -10.0 s does not fit in TimeoutStopSec=50 s"),
]


@pytest.fixture(scope="module")
def stop_checks(tmp_path_factory):
    """STOP_CHECK over every case of STOP_CASES, in one run (each case's variables its host's)."""
    tmp = tmp_path_factory.mktemp("stop")
    base = {"dflash_service_target_gpus": "cpu", "dflash_service_drafter_gpus": "cpu",
            "dflash_service_target_model": str(tmp), "dflash_service_data_dir": str(tmp)}
    return play_cases(tmp, STOP_CHECK, [{**base, **extra} for extra, _ in STOP_CASES],
                      ANSIBLE_ROLES_PATH=str(REPO / "roles"))


@pytest.mark.parametrize("case", range(len(STOP_CASES)), ids=[str(e) for _, e in STOP_CASES])
def test_an_inconsistent_stop_timeout_pair_is_refused_up_front(stop_checks, case):
    error = STOP_CASES[case][1]
    failed, text = stop_checks[f"case{case}"]
    if error is None:
        assert "does not fit" not in text, text[-2000:]      # (the trainer's own check may still refuse the empty data dir)
    else:
        assert failed and error in text, text[-3000:]
