"""The stores behind one seam (``seam.Store``), the registry that maps a location to its
store, and what stores share: worker-thread trips, owners and clocks.
"""
