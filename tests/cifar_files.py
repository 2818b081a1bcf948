"""Small CIFAR-10 binary files for tests that run the examples on "real" data."""
import numpy as np


def write_cifar_batches(folder, records_per_file, seed=0):
    """Writes data_batch_1..5.bin and test_batch.bin into a new ``folder``, in the official
    CIFAR-10 binary layout (1 label byte + 3072 pixel bytes per record), random contents."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        labels = rng.integers(0, 10, records_per_file, dtype=np.uint8)
        pixels = rng.integers(0, 256, (records_per_file, 3072), dtype=np.uint8)
        np.concatenate([labels[:, None], pixels], axis=1).tofile(folder / name)
