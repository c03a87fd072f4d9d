from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

from engine.block_hash import ROOT_PARENT_HASH, hash_block_tokens


def reference_hash(parent: bytes, tokens: list[int], extra_key: str) -> bytes:
    """The documented encoding, written out independently."""
    data = bytearray(parent)
    for t in tokens:
        data += t.to_bytes(4, "little")
    extra = extra_key.encode()
    data += len(extra).to_bytes(4, "little") + extra
    return hashlib.sha256(bytes(data)).digest()


def test_chain_matches_documented_encoding():
    tokens = list(range(1000, 1040))
    hashes = hash_block_tokens(tokens, 16, extra_key="rev-a")
    assert len(hashes) == 2  # the trailing 8 tokens are not a full block
    h0 = reference_hash(ROOT_PARENT_HASH, tokens[:16], "rev-a")
    assert hashes == [h0, reference_hash(h0, tokens[16:32], "rev-a")]


def test_incremental_extension_equals_full_hash():
    tokens = list(range(64))
    full = hash_block_tokens(tokens, 16)
    head = hash_block_tokens(tokens[:32], 16)
    tail = hash_block_tokens(tokens[32:], 16, parent_hash=head[-1])
    assert head + tail == full


def test_prefix_and_extra_key_sensitivity():
    a = hash_block_tokens(list(range(32)), 16)
    b = hash_block_tokens([0, *range(1, 16), 99, *range(17, 32)], 16)
    assert a[0] == b[0] and a[1] != b[1]
    assert hash_block_tokens(list(range(16)), 16, "x") != hash_block_tokens(
        list(range(16)), 16, "y"
    )


def test_hashes_are_identical_in_another_process_and_module_is_torch_free():
    tokens = list(range(5, 53))
    code = (
        "import sys; from engine.block_hash import hash_block_tokens; "
        f"print(','.join(h.hex() for h in hash_block_tokens({tokens}, 16, 'k'))); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    hashes_hex, torch_loaded = out.stdout.split()
    assert hashes_hex == ",".join(h.hex() for h in hash_block_tokens(tokens, 16, "k"))
    assert torch_loaded == "False"
    assert struct.calcsize("<I") == 4
