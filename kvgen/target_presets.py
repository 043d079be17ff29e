"""Built-in target presets: plain data, turned into ``Target`` objects by ``kvgen.targets``.

Units, so that every row reads the same way:

- memory: where the vendor says "GB" it means 10**9 bytes, and so do we
  (80 GB -> 80e9). The driver reports a little more or less than the
  datasheet; ``detect_target`` replaces this with the device's real value.
- bandwidth: bytes/s, GB/s and TB/s taken as 1e9 / 1e12.
- shared memory per SM and L2: KB/MB as CUDA reports them, i.e. KiB/MiB
  (228 KB -> 228 * 1024), matching ``cudaDeviceProp``.
- host link: bytes/s per direction (PCIe Gen4 x16 ~32 GB/s, Gen5 x16 ~64
  GB/s; NVLink-C2C 900 GB/s total, 450 GB/s each way).

This module imports nothing from kvgen so that the table stays pure data.
"""

KiB = 1024
MiB = 1024 * 1024
GB = 10**9

# Column order of every row in PRESETS.
COLUMNS = (
    "name", "memory_bytes", "memory_bandwidth", "sm_count", "shared_mem_per_sm", "l2_bytes",
    "arch", "fp8", "host_link_bandwidth", "vendor",
)

# fmt: off
PRESETS = (
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s; GH100 whitepaper: 132 SMs, 228 KB smem/SM, 50 MB L2; PCIe Gen5
    ("h100", 80 * GB, 3.35e12, 132, 228 * KiB, 50 * MiB, "sm_90", True, 64e9, "nvidia"),
    # NVIDIA H100 Tensor Core GPU datasheet, PCIe: 80 GB HBM2e, 2.0 TB/s, 114 SMs; PCIe Gen5
    ("h100-pcie", 80 * GB, 2.0e12, 114, 228 * KiB, 50 * MiB, "sm_90", True, 64e9, "nvidia"),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: 141 GB HBM3e, 4.8 TB/s; 132 SMs; L2 60 MB as cudaDeviceProp reports on an H200; PCIe Gen5
    ("h200", 141 * GB, 4.8e12, 132, 228 * KiB, 60 * MiB, "sm_90", True, 64e9, "nvidia"),
    # NVIDIA GH200 Grace Hopper Superchip datasheet, 96 GB HBM3 variant: 4.0 TB/s; 132 SMs, L2 as H100; NVLink-C2C 900 GB/s = 450 GB/s each way
    ("gh200", 96 * GB, 4.0e12, 132, 228 * KiB, 50 * MiB, "sm_90", True, 450e9, "nvidia"),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: 2,039 GB/s; GA100 whitepaper: 108 SMs, 164 KB smem/SM, 40 MB L2; no FP8; PCIe Gen4
    ("a100", 80 * GB, 2.039e12, 108, 164 * KiB, 40 * MiB, "sm_80", False, 32e9, "nvidia"),
    # NVIDIA A100 Tensor Core GPU datasheet, 40GB: 1,555 GB/s; otherwise as a100
    ("a100-40gb", 40 * GB, 1.555e12, 108, 164 * KiB, 40 * MiB, "sm_80", False, 32e9, "nvidia"),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 142 SMs, FP8; Ada whitepaper: 100 KB smem/SM (CC 8.9), 96 MB L2; PCIe Gen4
    ("l40s", 48 * GB, 864e9, 142, 100 * KiB, 96 * MiB, "sm_89", True, 32e9, "nvidia"),
    # NVIDIA GeForce RTX 4090 specs / Ada whitepaper: 24 GB GDDR6X, 1008 GB/s, 128 SMs, 100 KB smem/SM, 72 MB L2, FP8; PCIe Gen4
    ("rtx4090", 24 * GB, 1008e9, 128, 100 * KiB, 72 * MiB, "sm_89", True, 32e9, "nvidia"),
    # NVIDIA GeForce RTX 5090 specs / Blackwell whitepaper: 32 GB GDDR7, 1792 GB/s, 170 SMs, 100 KB smem/SM (CC 12.0), 96 MB L2; PCIe Gen5
    ("rtx5090", 32 * GB, 1792e9, 170, 100 * KiB, 96 * MiB, "sm_120", True, 64e9, "nvidia"),
    # NVIDIA DGX/HGX B200 datasheet: 192 GB HBM3e, 8 TB/s per GPU; 148 SMs, 228 KB smem/SM (CC 10.0), L2 126 MB as cudaDeviceProp reports; PCIe Gen5
    ("b200", 192 * GB, 8.0e12, 148, 228 * KiB, 126 * MiB, "sm_100", True, 64e9, "nvidia"),
    # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, 304 CUs, 64 KB LDS/CU, 4 MB L2 per XCD x 8 (plus 256 MB Infinity Cache); PCIe Gen5
    ("mi300x", 192 * GB, 5.3e12, 304, 64 * KiB, 32 * MiB, "gfx942", True, 64e9, "amd"),
    # Nominal host: 64 GiB, 100 GB/s (a dual-channel DDR5 desktop is ~80-100 GB/s); one "SM"; the host link is the memory itself
    ("cpu", 64 * 1024**3, 100e9, 1, 0, 32 * MiB, "cpu", False, 100e9, "cpu"),
)
# fmt: on

# Other spellings accepted for a preset (lower case).
ALIASES = {
    "h100-sxm": "h100",
    "h100-sxm5": "h100",
    "h200-sxm": "h200",
    "a100-80gb": "a100",
    "a100-sxm4-80gb": "a100",
    "a100-sxm4-40gb": "a100-40gb",
    "rtx-4090": "rtx4090",
    "rtx-5090": "rtx5090",
    "host": "cpu",
}
