"""The benchmark run (`harness run all`, `harness trials`, `harness workloads`): servers, arms, workloads and
their kinds of cell, the client, the records, and the summary and comparisons read from them."""
