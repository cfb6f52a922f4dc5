"""obstore against s3fs on the local S3 server: conditional create, small and large objects (D328).

Run from the repository root, with s3fs installed beside the s3-local extra (it is not a
dependency): ``pip install s3fs && python scripts/compare_s3_clients.py``. Prints medians in ms.
"""

import json
import os
import statistics
import time

from e2e._launch.object_store import LocalS3


def timed(fn, n):
    t = []
    for i in range(n):
        s = time.perf_counter()
        fn(i)
        t.append(time.perf_counter() - s)
    return statistics.median(t) * 1e3


with LocalS3() as s3:
    os.environ.update(s3.environment())
    import obstore
    import s3fs
    from obstore.store import S3Store

    ob = S3Store("midflight", prefix="ob")
    env = s3.environment()
    fs = s3fs.S3FileSystem(
        endpoint_url=s3.endpoint, key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"]
    )
    small = b"x" * 300
    big = os.urandom(8 << 20)
    out = {}
    out["obstore_put_small_ms"] = timed(
        lambda i: obstore.put(ob, f"s/{i}", small, mode="create"), 200
    )
    out["s3fs_put_small_ms"] = timed(lambda i: fs.pipe_file(f"midflight/fs/s/{i}", small), 200)
    out["obstore_get_small_ms"] = timed(lambda i: bytes(obstore.get(ob, f"s/{i}").bytes()), 200)
    out["s3fs_get_small_ms"] = timed(lambda i: fs.cat_file(f"midflight/fs/s/{i}"), 200)
    out["obstore_put_8MiB_ms"] = timed(lambda i: obstore.put(ob, f"b/{i}", big, mode="create"), 5)
    out["s3fs_put_8MiB_ms"] = timed(lambda i: fs.pipe_file(f"midflight/fs/b/{i}", big), 5)
    out["obstore_get_8MiB_ms"] = timed(lambda i: bytes(obstore.get(ob, f"b/{i}").bytes()), 5)
    out["s3fs_get_8MiB_ms"] = timed(lambda i: fs.cat_file(f"midflight/fs/b/{i}"), 5)
    try:
        obstore.put(ob, "s/0", small, mode="create")
        out["obstore_create_refuses_second"] = False
    except Exception as e:
        out["obstore_create_refuses_second"] = type(e).__name__
    try:
        with fs.open("midflight/fs/s/0", "xb") as f:
            f.write(b"second")
        out["s3fs_exclusive_create_refuses_second"] = fs.cat_file("midflight/fs/s/0") == small
    except Exception as e:
        out["s3fs_exclusive_create_refuses_second"] = type(e).__name__
    out["load"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
