"""tslightning: exact gradient streaming (ThunderSyncRL) for agentic RL on Lightning / Fabric."""
