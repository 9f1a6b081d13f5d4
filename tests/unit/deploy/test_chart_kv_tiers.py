"""charts/baton and the KV offload tiers: off by default; a pool's kvOffloadGiB and kvDisk
become its workers' flags, the disk tier's volume (an emptyDir a little over its size, or the
source given) and its mount; a disk tier without the host tier is refused by name."""

from __future__ import annotations

from tests.unit.deploy.kube import container, deployment, flag, helm_template, pod_spec, run

DISK = "/var/cache/baton-kv"


def args_and_volumes(docs, role):
    dep = deployment(docs, role)
    volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
    mounts = {m["name"]: m for m in container(dep)["volumeMounts"]}
    return container(dep)["args"], volumes, mounts


def test_the_tiers_are_off_by_default(renders):
    for role in ("prefill", "decode"):
        args, volumes, _ = args_and_volumes(renders["defaults"], role)
        assert flag(args, "--kv-offload-gib") is None and flag(args, "--kv-disk-dir") is None
        assert "kv-disk" not in volumes


def test_a_pools_tiers_become_its_flags_volume_and_mount(helm):
    docs = helm_template(helm, sets=("decode.engine.kvOffloadGiB=8",
                                     "decode.engine.kvDisk.sizeGiB=100"))
    args, volumes, mounts = args_and_volumes(docs, "decode")
    assert flag(args, "--kv-offload-gib") == "8"
    assert (flag(args, "--kv-disk-dir"), flag(args, "--kv-disk-gib")) == (DISK, "100")
    assert volumes["kv-disk"] == {"name": "kv-disk", "emptyDir": {"sizeLimit": "107520Mi"}}
    assert mounts["kv-disk"]["mountPath"] == DISK
    args, volumes, _ = args_and_volumes(docs, "prefill")  # the other pool keeps its own
    assert flag(args, "--kv-offload-gib") is None and "kv-disk" not in volumes


def test_the_disk_tier_takes_the_volume_source_given(helm):
    docs = helm_template(helm, sets=(
        "prefill.engine.kvOffloadGiB=2", "prefill.engine.kvDisk.sizeGiB=50",
        "prefill.engine.kvDisk.volume.persistentVolumeClaim.claimName=kv-cache"))
    _, volumes, _ = args_and_volumes(docs, "prefill")
    assert volumes["kv-disk"] == {"name": "kv-disk",
                                  "persistentVolumeClaim": {"claimName": "kv-cache"}}


def test_a_disk_tier_without_the_host_tier_is_refused(helm):
    from tests.unit.deploy.kube import CHART, RELEASE

    out = run([helm, "template", RELEASE, CHART, "--set", "decode.engine.kvDisk.sizeGiB=10"])
    assert out.returncode != 0 and "decode.engine.kvOffloadGiB > 0" in out.stderr
