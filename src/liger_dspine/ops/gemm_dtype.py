"""The dtype a head projection's GEMM runs in, shared by the ops that project rows through a vocabulary head."""

import torch


def gemm_dtype(rows: torch.Tensor, weight: torch.Tensor, what: str) -> torch.dtype:
    """The dtype ``F.linear(rows, weight)`` would compute in: autocast's when it is on, else the inputs' own,
    which must then match (a ValueError naming ``what`` otherwise)."""
    device_type = rows.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if rows.dtype != weight.dtype:
        raise ValueError(
            f"liger-dspine: {what}: rows are {rows.dtype} and the weight is {weight.dtype}; "
            "outside autocast they must match"
        )
    return rows.dtype
