"""Section copy: the device's copy bandwidth, the memory floor that the step sections compare against."""


def run(bench):
    bench.copy_bandwidth()


def summary(data) -> list[str]:
    return [f"copy bandwidth: {data['copy_gb_per_s']:.1f} GB/s"] if "copy_gb_per_s" in data else []
