import numpy as np
import pytest

from ckptd.transports.roce.extract import ll_unpack
from ckptd.testing.synth.wire import ll_encode

ll = pytest.importorskip("cython_ext.batch", reason="Cython extensions not built: pip install -e .")


@pytest.mark.parametrize("nbytes", [0, 8, 16, 1000, 4096 * 3])
def test_cython_matches_reference(nbytes):
    rng = np.random.default_rng(nbytes)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    wire = ll_encode(data, 7)
    ref, flag, ok = ll_unpack(wire, 7)
    out = bytearray(len(wire) // 2)
    assert ll.ll_unpack_into(wire, out, 7) is True and ok
    assert bytes(out) == ref and ref[:nbytes] == data
    if wire:
        bad = bytearray(wire)
        bad[5] ^= 1  # one flag word of the first line
        assert ll.ll_unpack_into(bytes(bad), out, 7) is False
        assert not ll_unpack(bytes(bad), 7)[2]
