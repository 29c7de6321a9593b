"""Controllers above the runtime that watch a running job and change its plan: :mod:`whale.elastic.straggler`
re-balances the data-parallel shares when a device slows down. The runtime executes; these decide (with the
planner's pure functions)."""
