"""`redknot serve`'s KV offload and KV event flags: sizes, the options they build, clear refusals."""

import argparse

import pytest

from redknot.serve.cli import add_arguments, byte_size, kv_events_options, kv_offload_options


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_byte_sizes_take_binary_suffixes():
    assert byte_size("512") == 512 and byte_size("64K") == 64 << 10 and byte_size("8G") == 8 << 30
    assert byte_size("1.5T") == int(1.5 * (1 << 40)) and byte_size("16GiB") == 16 << 30 and byte_size("2mb") == 2 << 20
    for bad in ("", "G", "-1G", "12Q"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_offload_flags_build_the_tiers_config():
    assert kv_offload_options(parse()) is None
    cfg = kv_offload_options(parse("--kv-offload-cpu-bytes", "2G", "--kv-disk-dir", "/tmp/kv", "--kv-disk-bytes", "10G",
                                   "--kv-remote", "redis://127.0.0.1:6379/0", "--kv-remote-ttl", "60",
                                   "--kv-write-policy", "write_back"))
    assert (cfg.cpu_bytes, cfg.disk_dir, cfg.disk_bytes) == (2 << 30, "/tmp/kv", 10 << 30)
    assert cfg.redis_url == "redis://127.0.0.1:6379/0" and cfg.redis_ttl_s == 60 and cfg.write_policy == "write_back"
    assert kv_offload_options(parse("--kv-cpu-bytes", "1M", "--kv-redis-url", "redis://h:1")).redis_url == "redis://h:1"
    with pytest.raises(SystemExit, match="disk_bytes"):
        kv_offload_options(parse("--kv-disk-dir", "/tmp/kv"))


def test_kv_events_flag_takes_vllms_json():
    assert kv_events_options(parse()) is None
    cfg = kv_events_options(parse("--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:7000", '
                                                        '"documents": true}'))
    assert cfg.endpoint == "tcp://*:7000" and cfg.documents
    for bad in ("{not json", "[1]", '{"enable_kv_cache_events": true, "publisher": "nats"}'):
        with pytest.raises(SystemExit, match="kv-events-config"):
            kv_events_options(parse("--kv-events-config", bad))
