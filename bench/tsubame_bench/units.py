"""Sizes and rates as the case files and the command lines write them."""
import re

from . import HarnessError


def parse_size(text):
    """'512M', '4G', '256K', '1024' -> bytes (binary multiples, as tsubame and QEMU)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise HarnessError(f"'{text}' is not a size (try 512M or 4G)")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def parse_rate(text):
    """'1gbit', '10Gbit', '500mbit' (bits) or '100MB' (bytes) per second -> bits per second (decimal, as tc)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(bit|Bit|BIT|B)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise HarnessError(f"'{text}' is not a rate (try 1gbit, 10gbit, 500mbit or 100MB)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    per_unit = 8 if m.group(3) == "B" else 1
    return int(float(m.group(1)) * scale * per_unit)


def tsubame_rate_arg(bits_per_s):
    """Bits per second -> a `--max-bandwidth` value tsubame parses (decimal Mbit)."""
    return f"{bits_per_s / 1e6:g}Mbit"


def tbf_burst_bytes(bits_per_s):
    """tbf bucket size: about 4 ms of traffic, at least 512 KiB (1gbit: 512kb, 10gbit: ~5mb)."""
    return max(512 * 1024, int(bits_per_s / 8 * 0.004))
