package PVE::Storage;

# Stand-in for the API version PVE::Storage announces (APIVER), which a custom plugin
# may read; tests/test_proxmox_plugin.py sets it through PVE_STANDIN_APIVER.

use strict;
use warnings;

sub APIVER { return $ENV{PVE_STANDIN_APIVER} // 12; }

1;
