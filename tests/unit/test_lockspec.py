from envbuild.plan.lockspec import LockLayer, RuntimeConfig, expand, make_lock, merge_config
from envbuild.store import MEDIA_TYPE_CONFIG, MemoryStore, put_json
from runtime_shim.node.locks import resolve
from tests.oci_schemas import IMAGE_SPEC, assert_valid

D = "sha256:" + "a" * 64


def _layers():
    return [LockLayer("base", "base", "sha256:" + "1" * 64, "sha256:" + "b" * 64,
                      "sha256:" + "c" * 64, 100, "sha256:" + "d" * 64),
            LockLayer("ws", "workspace", "sha256:" + "2" * 64, "sha256:" + "e" * 64,
                      "sha256:" + "f" * 64, 50, D)]


def test_lock_is_a_valid_oci_image_and_deterministic():
    cfg = merge_config([RuntimeConfig(env={"LANG": "C.UTF-8"}),
                        RuntimeConfig(workdir="/workspace", cmd=("sh",))])
    lock = make_lock("swe", _layers(), cfg)
    assert_valid(IMAGE_SPEC, "image-manifest-schema.json", lock.manifest)
    assert_valid(IMAGE_SPEC, "config-schema.json", lock.config)
    assert lock.manifest_bytes == make_lock("swe", _layers(), cfg).manifest_bytes
    assert lock.config["rootfs"]["diff_ids"] == ["sha256:" + "c" * 64, "sha256:" + "f" * 64]
    assert lock.manifest["layers"][1]["annotations"]["org.envbuild.role"] == "workspace"
    assert lock.config["config"]["WorkingDir"] == "/workspace"


def test_runtime_side_reads_back_what_the_lock_says():
    cfg = merge_config([RuntimeConfig(env={"LANG": "C.UTF-8"}, hostname="box"),
                        RuntimeConfig(workdir="/workspace", user="1000:1000")])
    lock = make_lock("swe", _layers(), cfg)
    store = MemoryStore()
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    digest = put_json(store, lock.manifest).digest
    store.put_ref("env/swe", digest)
    for ref in ("swe", "env/swe", digest):
        back = resolve(store, ref)
        assert back.digest == digest
        assert [(x.name, x.role, x.digest, x.diff_id, x.size, x.toc_digest, x.key)
                for x in back.layers] == [(x.name, x.role, x.digest, x.diff_id, x.size,
                                           x.toc_digest, x.key) for x in _layers()]
        assert back.workdir == "/workspace" and back.user == "1000:1000"
        assert back.hostname == "box" and back.env["LANG"] == "C.UTF-8"


def test_path_merges_in_layer_order_and_env_wins_last():
    cfg = merge_config([
        RuntimeConfig(env={"PATH": "/usr/bin:/bin"}),
        RuntimeConfig(env={"PATH": "/opt/toolkits/rg/bin:$PATH"}),
        RuntimeConfig(env={"PATH": "/opt/toolkits/pytest/bin:${PATH}", "X": "$UNSET-y"}),
        RuntimeConfig(user="1000:1000"),
    ])
    assert cfg.env["PATH"] == "/opt/toolkits/pytest/bin:/opt/toolkits/rg/bin:/usr/bin:/bin"
    assert cfg.env["X"] == "-y"
    assert cfg.user == "1000:1000"


def test_expand_leaves_plain_text():
    assert expand("a:b", {}) == "a:b"
