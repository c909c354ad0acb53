"""Planning: propagation, the ILP solver, redistribution paths and what the search prices (a Propagation)."""
