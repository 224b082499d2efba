"""The fused objective's switch: ``apply_liger_kernel_to_dspine(fused_objective=True)`` puts this function in
place of ``DSpineObjective.patched_fused_objective`` (on the class, or on one objective)."""


def fused_objective_on(self) -> bool:
    """An objective built without an explicit ``fused_objective`` runs the fused frozen-head kernel."""
    return True
