"""The curated public API: changing it must be deliberate."""

import kvshm

EXPECTED = {
    "BlockHasher", "CheckReport", "ChunkedLocalSpec", "ConfigError", "CrossAttentionSpec",
    "DuplicateRequest", "FullSpec", "InvalidArgument", "KVCacheManager", "KVShape",
    "KvshmError", "BadMultimodalInput", "MultiModalFeature",
    "MLASpec", "MambaSpec", "NoFreeBlocks", "PoolConfig", "PoolRefused", "PoolSegment", "Request",
    "RequestTableFull", "RequestTooLong", "SegmentError", "ShmSpaceError", "SinkFullSpec",
    "SlidingWindowSpec", "UnknownRequest", "check_segment", "hash_fingerprint",
    # the clients and the service's errors
    "Client", "connect", "SyncClient", "connect_sync", "BatchTooLarge", "ConnectionClosed",
    "ConnectionLost", "Forbidden", "FrameTooLarge", "HandshakeError", "HandshakeRequired",
    "HashMismatch", "InternalError", "NotOwner", "PoolInUse", "ProtocolError", "ReplyLost",
    "RequestTimeout", "ResumeFailed", "SocketInUse", "VersionMismatch",
}


def test_all_is_pinned():
    assert set(kvshm.__all__) == EXPECTED


def test_every_name_resolves():
    for name in kvshm.__all__:
        assert getattr(kvshm, name) is not None


def test_errors_share_one_base_with_codes():
    for name in kvshm.__all__:
        obj = getattr(kvshm, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, kvshm.KvshmError)
            assert obj.code.isupper()


def test_import_kvshm_needs_no_numpy():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys, kvshm; "
                          "print('numpy' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_import_kvshm_loads_the_clients_only_when_used():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys, kvshm; "
                          "print('kvshm.service.client' in sys.modules); "
                          "print(kvshm.connect.__module__, kvshm.NotOwner.code)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "kvshm.service.client", "NOT_OWNER"]
