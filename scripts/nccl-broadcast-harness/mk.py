"""Write tests/data/nccl/broadcast-<version>.json and allgather-<version>.json from the compiled
harness (own code): a broadcast of `bytes` int8, an allgather of `bytes` int8 a rank. 2.22+:
each channel's cbd part and chunk; before (2.14-2.21, h-<tag> built from genold.py): each
channel's sends of rank 0 as the device loop makes them, and every rank's number of sends."""
import json, subprocess, sys, itertools, re
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from ckptd.core.schedule import RingConfig
PROTO = {"ll": 0, "ll128": 1, "simple": 2}
counts = [1, 4, 7, 16, 64, 100, 1000, 4096, 12345, 65536, 100000, 262144, 524288, 524289, 10**6, 2**20, 2**22,
          6553600, 6553601, 2**24, 2**26, 250 * 2**20]
OLD_COUNTS = [c for c in counts if c <= 10**6] + [2**22 + 16]  # sends listed one by one: kept small
for tag, (fname, fn) in itertools.product(sys.argv[2:], [("broadcast", 0), ("allgather", 2)]):
    version = tag[1:].split("-")[0]
    v = tuple(int(x) for x in version.split(".")[:2])
    old = v < (2, 22)
    inputs, keys = [], []
    for B, nranks, cc, proto in itertools.product(OLD_COUNTS if old else counts, (2, 3, 8), (1, 2, 3, 4), PROTO):
        cfg = RingConfig(nranks, tuple(tuple(range(nranks)) for _ in range(cc)), proto, v)
        tuned, nt = cfg.tune(B * (nranks if fn == 2 else 1))  # allgather: tuned on nRanks*count
        for forced in [0] + ([1, 2, 3] if cc == 4 and nranks in (3, 8) else []):
            # forced channels keep the tuned threads (the tuner lowers channels before threads)
            inputs.append(f"{B} {nranks} {cc} {PROTO[proto]} {forced or tuned}" + (f" {nt}" if old else "") + f" {fn}")
            keys.append([B, nranks, cc, proto, forced])
    got = json.loads(subprocess.run([f"./h-{tag}"], input="\n".join(inputs), capture_output=True, text=True,
                                    check=True).stdout)
    ext = re.search(r'EXTRACTED = "(.*)";', open(f"ext-{tag}.cc").read()).group(1)
    if old:
        dev = ""
        cols = ["channel", [["output_offset", "bytes"], "... rank 0's sends in order"], ["sends of rank r"]]
    else:
        dev = "; " + re.search(r'EXTRACTED_DEV = "(.*)";', subprocess.run(
            ["python", "gendev.py", f"dev-{tag}.h"], capture_output=True, text=True).stdout).group(1)
        cols = ["channel", "part_offset", "part_bytes", "chunk_bytes"]
    head = {"nccl": version, "function": "broadcast (int8, ring, root 0)" if fn == 0 else
            "allgather (int8, ring, bytes a rank)",
            "extracted": f"{ext}{dev}",
            "columns": ["bytes", "nranks", "comm_channels", "protocol", "forced_channels", cols]}
    lines = [json.dumps(k + [g[5]], separators=(",", ":")) for k, g in zip(keys, got)]
    with open(f"{sys.argv[1]}/{fname}-{version}.json", "w") as f:
        f.write(json.dumps(head, separators=(",", ":"))[:-1] + ',\n"rows":[\n' + ",\n".join(lines) + "\n]}\n")
    print(fname, version, len(lines))
