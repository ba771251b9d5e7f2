"""Teams and quotas (issue 31, item 2): what one account or team may hold at once (GPUs, active jobs)
and use in a calendar month (GPU-hours, spend), decided in the transaction that takes the leases."""
