"""The analytic cost model: a model's ops and bytes (models), a device's rates (hardware), a layout (deploy),
priced per step (step, cost, moe, comm). Below the engine (SLO admission's step-time prior) and the planner."""
