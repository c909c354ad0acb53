"""Planning: propagation, cost model, solver and the Plan artifact."""
