"""`spopp report`: the paper's Table 1, Table 2 and Figure 1 from paired run folders."""
