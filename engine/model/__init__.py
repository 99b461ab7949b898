"""The target model and its passes: how it loads, how a pass runs and what a pass costs here. It knows nothing
of drafters or of the decode loop (a layout rule): the loop hands a pass plain arguments and reads what it returns.
"""
