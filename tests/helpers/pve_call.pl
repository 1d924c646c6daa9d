#!/usr/bin/perl
# Calls one method of the Proxmox VE plugin (packaging/proxmox/BulwarkPlugin.pm) as PVE
# would, with the stand-in base class of tests/helpers/pve/ (see its header for why).
# Usage: pve_call.pl METHOD JSON_ARRAY_OF_ARGS; the class is the invocant. Prints
# {"ok": [results in list context]} or {"error": "message"} as JSON, and exits 0 either way.

use strict;
use warnings;
use FindBin;
use lib "$FindBin::Bin/pve";
use JSON;

use PVE::Storage;
require "$FindBin::Bin/../../packaging/proxmox/BulwarkPlugin.pm";

my ($method, $args) = @ARGV;
my @args = @{ decode_json($args // '[]') };
my $class = 'PVE::Storage::Custom::BulwarkPlugin';
# `null` in JSON is undef in Perl, as PVE passes an absent snapshot name.
my @out = eval { $class->$method(@args) };
if (my $err = $@) {
    print encode_json({ error => "$err" }), "\n";
} else {
    print JSON->new->allow_nonref->canonical->encode({ ok => \@out }), "\n";
}
