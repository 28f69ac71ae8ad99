"""What ``import kvstore`` offers: the names users import, each the very object of its home
module, and an import that loads neither gRPC nor numpy until one of them is asked for."""

from __future__ import annotations

import subprocess
import sys

import kvstore
from kvstore import (
    BlockKey,
    Client,
    ClientTls,
    Fingerprint,
    KvStoreError,
    LeaseExpired,
    ModelIdentity,
    Unavailable,
    block_keys,
    connect,
    root_key,
)


def test_the_names_users_import_are_the_modules_own() -> None:
    from kvstore import client, errors, keys, tls

    assert (connect, Client, ClientTls) == (client.connect, client.Client, tls.ClientTls)
    assert (ModelIdentity, block_keys, root_key) == (keys.ModelIdentity, keys.block_keys, keys.root_key)
    assert (BlockKey, Fingerprint) == (keys.BlockKey, keys.Fingerprint)
    assert (KvStoreError, LeaseExpired, Unavailable) == (
        errors.KvStoreError,
        errors.LeaseExpired,
        errors.Unavailable,
    )
    assert set(errors.__all__) <= set(kvstore.__all__)


def test_every_name_in_all_exists() -> None:
    assert len(set(kvstore.__all__)) == len(kvstore.__all__)
    for name in kvstore.__all__:
        assert getattr(kvstore, name) is not None, name
    assert set(kvstore.__all__) <= set(dir(kvstore))
    assert isinstance(kvstore.__version__, str)


def test_import_kvstore_loads_no_grpc_numpy_or_torch() -> None:
    probe = "import sys, kvstore; print(sorted({'grpc', 'numpy', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    probe = "import sys; from kvstore import connect; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
