"""Resource layer: the inventory of sites, clusters and WAN links; heartbeats; discovery; drivers."""
