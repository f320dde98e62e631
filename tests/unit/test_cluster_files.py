"""cluster/: the Ray cluster launcher file against Ray's own schema, the runtime environment as
Ray packages it, and the KubeRay RayJob against KubeRay's CRD schema and Kubernetes' (no cluster here: structure, not behaviour)."""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import shlex
import zipfile
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from servetune.local_ray import SERVE_SYSTEM_CONFIG
from servetune.space_file import load_space
from tests.unit.test_export_deploy import validate_definition, validate_k8s

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
LAUNCHER = CLUSTER / "aws-h100.yaml"
RUNTIME_ENV = CLUSTER / "runtime_env.yaml"
RAYJOB = CLUSTER / "kuberay-rayjob.yaml"
#: GPUs of the AWS instance types the launcher may use (8 each: a node of the GPU search spaces).
GPU_INSTANCES = {"p5.48xlarge": 8, "p5e.48xlarge": 8, "p4d.24xlarge": 8, "p4de.24xlarge": 8}
GPU_SPACES = [ROOT / "search_spaces" / f"{n}.yaml" for n in ("chat-latency", "rag", "offline-batch", "long-context")]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# --- the cluster launcher (ray up) ---------------------------------------------------------


def test_launcher_matches_rays_schema():
    config = load(LAUNCHER)
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)  # as written


def test_launcher_with_rays_defaults_passes_rays_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(load(LAUNCHER)))  # what `ray up` validates: defaults merged
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"


def test_launcher_has_a_cpu_head_and_8_gpu_workers():
    config = load(LAUNCHER)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["node_config"]["InstanceType"].split(".")[0][0] in "mcr"  # a general-purpose/compute/memory type
    assert head["resources"].get("CPU") == 0 and not head["resources"].get("GPU")
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert workers
    for name, worker in workers.items():
        assert worker["node_config"]["InstanceType"] in GPU_INSTANCES, name
        assert 0 <= worker["min_workers"] <= worker["max_workers"] <= config["max_workers"]
    devices_per_node = {load_space(p).hardware.devices_per_node for p in GPU_SPACES}
    assert {GPU_INSTANCES[w["node_config"]["InstanceType"]] for w in workers.values()} == devices_per_node


def test_launcher_installs_servetune_with_the_gpu_extra_from_the_mounted_repository():
    config = load(LAUNCHER)
    (remote, local), *_ = config["file_mounts"].items()
    assert local == "."
    installs = [c for c in config["setup_commands"] if "install" in c and "[gpu]" in c]
    assert installs and remote.replace("/home/ubuntu", "$HOME") in installs[0]
    assert {".venv", ".git", "servetune-results"} <= set(config["rsync_exclude"])
    assert any("mkdir -p /mnt/results" in c for c in config["setup_commands"])  # the driver's results, on the head
    # Runs as written: no command depends on a shared file system the user must first create and name.
    assert not [c for c in config["setup_commands"] if "mount -t nfs" in c or ".efs." in c]


def test_launcher_commands_are_well_formed_shell():
    config = load(LAUNCHER)
    for key in ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands"):  # fmt: skip
        for command in config.get(key, []):
            shlex.split(command)  # unbalanced quotes (or a YAML comment eating half a line) fail here
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--head" in head_start and "--autoscaling-config=~/ray_bootstrap_config.yaml" in head_start
    assert "$RAY_HEAD_IP:6379" in " ".join(config["worker_start_ray_commands"])


def ray_start_options(command: str) -> dict:
    """What `ray start` makes of a shell command line that runs it: Ray's own click command parses the words the
    shell would pass (nothing is started), so a flag Ray does not take, or a value its type refuses, fails here."""
    from ray.scripts.scripts import start

    words = shlex.split(command)
    at = next(i for i, (a, b) in enumerate(itertools.pairwise(words)) if (a, b) == ("ray", "start"))
    return start.make_context("ray start", words[at + 2 :]).params


def kuberay_head_command(params: dict[str, str]) -> str:
    """The head's `ray start` as KubeRay writes it from rayStartParams (its convertParamMap: ` --key=value ` in
    sorted order, "true" a bare flag) into the container's shell command."""
    flags = [
        f"--{k}" if v.lower() == "true" else f"--{k}={v}" for k, v in sorted(params.items()) if v.lower() != "false"
    ]
    return "ulimit -n 65536; ray start --head " + " ".join(flags)


def test_the_launchers_head_starts_ray_with_servetunes_system_config():
    """Workers at niceness 0 and a 1 s metrics interval on a cluster too, as the local Ray has them: on the head's
    `ray start` (workers take the system config from the head; Ray refuses it on a worker's)."""
    config = load(LAUNCHER)
    (head,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    options = ray_start_options(head)
    assert options["head"] and options["system_config"] == SERVE_SYSTEM_CONFIG
    for worker in [c for c in config["worker_start_ray_commands"] if "ray start" in c]:
        assert ray_start_options(worker)["system_config"] is None


def test_the_rayjobs_head_starts_ray_with_servetunes_system_config(manifests):
    cluster = manifests["RayJob"]["spec"]["rayClusterSpec"]
    options = ray_start_options(kuberay_head_command(cluster["headGroupSpec"]["rayStartParams"]))
    assert options["system_config"] == SERVE_SYSTEM_CONFIG and options["num_cpus"] == 0
    assert all("system-config" not in group.get("rayStartParams", {}) for group in cluster["workerGroupSpecs"])


def test_doctors_fix_is_the_system_config_and_names_a_section_of_the_cluster_readme():
    from servetune.doctor import SYSTEM_CONFIG_COMMAND, SYSTEM_CONFIG_FIX, SYSTEM_CONFIG_SECTION

    assert ray_start_options(SYSTEM_CONFIG_COMMAND)["system_config"] == SERVE_SYSTEM_CONFIG
    path, section = SYSTEM_CONFIG_SECTION
    headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.MULTILINE)
    assert section in headings and SYSTEM_CONFIG_COMMAND in SYSTEM_CONFIG_FIX and section in SYSTEM_CONFIG_FIX


# --- the runtime environment (ray job submit --runtime-env) ---------------------------------


def test_runtime_env_is_one_ray_accepts():
    from ray.runtime_env import RuntimeEnv

    env = load(RUNTIME_ENV)
    assert set(env) <= RuntimeEnv.known_fields, set(env) - RuntimeEnv.known_fields
    RuntimeEnv(**env)  # checks types: env_vars str -> str, excludes a list
    assert env["working_dir"] == "."
    assert (ROOT / env["env_vars"]["PYTHONPATH"] / "servetune" / "__init__.py").exists()


def test_runtime_env_uploads_the_code_and_not_the_venv(tmp_path):
    from ray._private.runtime_env.packaging import create_package

    env = load(RUNTIME_ENV)
    package = tmp_path / "working_dir.zip"
    # As Ray packs the working dir, relying on the excludes alone (not on .gitignore).
    create_package(str(ROOT), package, include_gitignore=False, excludes=env["excludes"])
    names = zipfile.ZipFile(package).namelist()
    needed_files = (
        "pyproject.toml",
        "src/servetune/__init__.py",
        "trials/workloads/chat.yaml",
        "search_spaces/chat-latency.yaml",
    )
    for needed in needed_files:
        assert needed in names, needed
    for name in names:
        assert not name.startswith((".venv/", ".git/", "servetune-results/")) and "__pycache__" not in name, name
    assert package.stat().st_size < 10 * 2**20


def test_a_large_untracked_folder_in_the_checkout_stays_out_of_the_upload(tmp_path):
    """Models, results and scratch data in a checkout are normal: .rayignore keeps the job's upload to what a study
    runs from, whatever else is there (the README's ``ray job submit`` failed with 97 MB of untracked output)."""
    import shutil

    from ray._private.runtime_env.packaging import create_package

    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "src", checkout / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("trials", "search_spaces", "cluster"):
        shutil.copytree(ROOT / folder, checkout / folder)
    for name in (".rayignore", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, checkout / name)
    (checkout / "my-space.yaml").write_text("name: mine\n")  # a user's own study, at the top
    (checkout / "scratch" / "weights").mkdir(parents=True)
    (checkout / "scratch" / "weights" / "model.safetensors").write_bytes(os.urandom(12 * 2**20))
    (checkout / "big.bin").write_bytes(os.urandom(2**20))
    package = tmp_path / "working_dir.zip"
    create_package(str(checkout), package, include_gitignore=True, excludes=load(RUNTIME_ENV)["excludes"])
    names = zipfile.ZipFile(package).namelist()
    for needed in ("src/servetune/__init__.py", "trials/workloads/chat.yaml", "search_spaces/chat-latency.yaml",
                   "cluster/runtime_env.yaml", "my-space.yaml", "pyproject.toml"):  # fmt: skip
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("scratch", "big.bin", "README"))], names
    assert package.stat().st_size < 4 * 2**20  # servetune and its data (about 2 MiB), not the 12 MiB of weights


# --- KubeRay ---------------------------------------------------------------------------------

#: KubeRay's RayJob CRD schema (ray.io/v1), its pod templates left to Kubernetes' own (tests/data/kuberay).
RAYJOB_SCHEMA = ROOT / "tests" / "data" / "kuberay" / "rayjob.schema.json"
POD_TYPE = "x-servetune-k8s-type"


def strict(schema: dict) -> dict:
    """The CRD's schema refusing unknown fields. The API server drops the unknown fields of a structural schema
    without a word (or refuses them under ``kubectl apply --validate=strict``), so a misspelt one would be ignored;
    here it fails. Fields kept open (``x-kubernetes-preserve-unknown-fields``) stay open."""
    if not isinstance(schema, dict):
        return schema
    out = {k: [strict(v) for v in vals] if isinstance(vals, list) else strict(vals) for k, vals in schema.items()}
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    return out


def pod_templates(obj: object, schema: dict, path: str = "") -> list[tuple[str, dict]]:
    """Where the schema says a core/v1 PodTemplateSpec sits (``x-servetune-k8s-type``), the objects there."""
    if schema.get(POD_TYPE):
        return [(path, obj)] if isinstance(obj, dict) else []
    found: list[tuple[str, dict]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in schema.get("properties", {}):
                found += pod_templates(value, schema["properties"][key], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, value in enumerate(obj):
            found += pod_templates(value, schema["items"], f"{path}[{i}]")
    return found


def rayjob_errors(job: dict) -> list[str]:
    """What KubeRay's schema, strict, and Kubernetes' for each pod template find wrong in ``job``."""
    schema = json.loads(RAYJOB_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(strict(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(job)]
    for path, template in pod_templates(job, schema):
        try:
            validate_definition(template, "io.k8s.api.core.v1.PodTemplateSpec")
        except jsonschema.ValidationError as exc:
            errors.append(f"{path}: {exc.message}")
    return errors


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(RAYJOB.read_text()) if d]
    return {d["kind"]: d for d in docs if d["kind"] != "PersistentVolumeClaim"}


@pytest.fixture(scope="module")
def claims() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(RAYJOB.read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}


def pod_volumes(template: dict) -> dict[str, dict]:
    return {v["name"]: v for v in template["spec"].get("volumes", [])}


def test_rayjob_is_valid_against_kuberays_crd_and_its_pods_against_kubernetes(manifests, claims):
    job = manifests["RayJob"]
    assert job["apiVersion"] == "ray.io/v1" and job["metadata"]["name"]
    assert rayjob_errors(job) == []
    assert len(pod_templates(job, json.loads(RAYJOB_SCHEMA.read_text()))) == 1 + len(
        job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    )
    for claim in claims.values():
        validate_k8s(claim)


def test_the_rayjob_check_catches_a_misspelt_field_and_a_bad_pod(manifests):
    """The check above can fail: a misspelt field of the RayJob, a container field Kubernetes does not know, and a
    number where KubeRay's schema takes a string."""
    job = copy.deepcopy(manifests["RayJob"])
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["minReplica"] = 1
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0  # `ray start` takes strings
    errors = rayjob_errors(job)
    assert [any(word in e for e in errors) for word in ("minReplica", "imagePullPolice", "num-gpus")] == [True] * 3


def test_rayjob_has_what_kuberay_needs(manifests):
    job = manifests["RayJob"]
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__  # the Ray servetune pins
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"] and cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"] and 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_rayjob_runs_the_chat_latency_study_on_shared_storage(manifests, claims):
    spec = manifests["RayJob"]["spec"]
    match = re.search(r"servetune run (\S+) --storage (\S+)", spec["entrypoint"])
    assert match, spec["entrypoint"]
    space_file, storage = match.groups()
    assert space_file == "search_spaces/chat-latency.yaml" and (ROOT / space_file).exists()
    claim = claims["servetune-results"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # the head and every GPU pod mount it
    cluster = spec["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        template = group["template"]
        volumes = pod_volumes(template)
        container = template["spec"]["containers"][0]
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, mount  # every mount has its volume
        shared = [m["mountPath"] for m in container["volumeMounts"]
                  if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]]  # fmt: skip
        assert any(storage == p or storage.startswith(p.rstrip("/") + "/") for p in shared), (storage, shared)


def test_rayjob_keeps_the_hugging_face_cache_of_every_gpu_pod_on_a_persistent_claim(manifests, claims):
    """The weights prefetched before the first trial (servetune/prefetch.py) outlive the pod: a claim, not an emptyDir,
    mounted where huggingface_hub and vLLM look (the image's HOME, no HF_HOME set), by every worker replica."""
    cluster = manifests["RayJob"]["spec"]["rayClusterSpec"]
    for group in cluster["workerGroupSpecs"]:
        template = group["template"]
        container = template["spec"]["containers"][0]
        assert not any(e["name"] in ("HF_HOME", "HF_HUB_CACHE") for e in container.get("env", []))
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/home/ray/.cache/huggingface"]
        volume = pod_volumes(template)[mount["name"]]
        assert "emptyDir" not in volume
        claim = claims[volume["persistentVolumeClaim"]["claimName"]]
        assert claim["apiVersion"] == "v1" and claim["spec"]["resources"]["requests"]["storage"]
        if group["maxReplicas"] > 1:  # pods on several nodes mount one claim
            assert "ReadWriteMany" in claim["spec"]["accessModes"]


def test_rayjob_gpu_workers_are_a_node_of_the_space(manifests):
    cluster = manifests["RayJob"]["spec"]["rayClusterSpec"]
    devices_per_node = load_space(ROOT / "search_spaces" / "chat-latency.yaml").hardware.devices_per_node
    head_resources = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in head_resources.get("limits", {})
    assert cluster["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"  # trials never land on the head
    images = {cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]}
    for group in cluster["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        images.add(container["image"])
        limits, requests = container["resources"]["limits"], container["resources"].get("requests", {})
        assert int(limits["nvidia.com/gpu"]) == devices_per_node
        # Kubernetes wants GPU requests equal to limits.
        assert requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"]) == limits["nvidia.com/gpu"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/dev/shm" in mounts  # vLLM's tensor-parallel workers share memory
    assert len(images) == 1  # the driver and the trials run the same servetune


def test_rayjob_gives_the_driver_mlflow_from_a_secret(manifests):
    head = manifests["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head["env"]}
    ref = env["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]


def test_images_and_rayversion_agree_with_the_dockerfile(manifests):
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    base = re.search(r"^FROM rayproject/ray:(\S+)", dockerfile, re.M)
    assert base and base.group(1).startswith(ray.__version__ + "-"), base
    assert re.search(r'pip install .*-e "\.\[gpu\]"', dockerfile)
    workdir = re.search(r"^WORKDIR (\S+)", dockerfile, re.M).group(1)
    spec = manifests["RayJob"]["spec"]
    assert f"cd {workdir} " in spec["entrypoint"]  # the entrypoint's relative space file is the image's


# --- the README's commands name files that exist -------------------------------------------


def test_readme_commands_name_existing_files():
    readme = (CLUSTER / "README.md").read_text()
    for command in ("ray up cluster/aws-h100.yaml", "--runtime-env cluster/runtime_env.yaml",
                    "kubectl apply -f cluster/kuberay-rayjob.yaml", "docker build -f cluster/Dockerfile"):  # fmt: skip
        assert command in readme, command
    for path in set(re.findall(r"\b((?:cluster|search_spaces)/[\w.-]+\.(?:yaml|md)|cluster/Dockerfile)\b", readme)):
        assert (ROOT / path).exists(), path


# --- the nodes against the spaces (study/nodes.py: a trial runs inside one node) --------------

#: vCPUs of the launcher's GPU instance types (AWS), beside their GPUs.
INSTANCE_CPUS = {"p5.48xlarge": 192, "p5e.48xlarge": 192, "p4d.24xlarge": 96, "p4de.24xlarge": 96}


def worker_nodes() -> dict[str, dict[str, float]]:
    """Each worker node of cluster/ as Ray would see it: its CPUs and GPUs."""
    config = load(LAUNCHER)
    nodes = {}
    for name, t in config["available_node_types"].items():
        if name != config["head_node_type"]:
            kind = t["node_config"]["InstanceType"]
            nodes[f"launcher {name}"] = {
                "CPU": float(INSTANCE_CPUS[kind]),
                "GPU": float(GPU_INSTANCES[kind]),
                **t.get("resources", {}),
            }
    docs = [d for d in yaml.safe_load_all(RAYJOB.read_text()) if d]
    job = next(d for d in docs if d["kind"] == "RayJob")
    for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        cpus = float(group["rayStartParams"].get("num-cpus", limits["cpu"]))
        nodes[f"rayjob {group['groupName']}"] = {"CPU": cpus, "GPU": float(limits["nvidia.com/gpu"])}
    return nodes


@pytest.mark.parametrize("space_path", GPU_SPACES, ids=lambda p: p.stem)
def test_every_trial_of_the_gpu_spaces_fits_one_worker_node_and_a_full_node_has_its_cpus(space_path):
    from servetune.study.nodes import placement_problem
    from servetune.study.packing import trial_sizes
    from servetune.trial.context import bundle

    space = load_space(space_path)
    kept, _ = space.grid() if space.search.algorithm == "grid" else ([{}], [])
    sizes = trial_sizes(space)
    for name, node in worker_nodes().items():
        for size in sizes:  # one trial of each size the space can propose
            want = {"CPU": float(space.hardware.cpus_per_trial), "GPU": float(size)}
            assert placement_problem(want, [node]) is None, (name, size, placement_problem(want, [node]))
        # the smallest trials filling the node's GPUs still have their CPUs beside them
        at_once = int(node["GPU"]) // max(min(sizes), 1)
        assert at_once * space.hardware.cpus_per_trial <= node["CPU"], (name, at_once, node)
        for params in kept[:50]:
            assert placement_problem(bundle(space, params), [node]) is None, (name, params)
